"""Speculative decoding, exact: a drafter proposes the next few tokens, one forward of the model over the
last token and the proposals (`exact=True`: each logit bitwise what one-token steps give, on the native
kernels) yields the model's own next token after each of them, and the proposals are taken while they
agree with it. Every token is still picked by the sequence from the model's own logits, in order, with
its own generator, so the output is the one plain decoding gives: greedy token for token, sampled
(temperature, top-k/p, penalties, seeds) draw for draw. (With a one-hot proposal, sampling x ~ p and
keeping the proposal iff x equals it is speculative sampling's accept-with-p(d), resample-from-the-
rest rule.) A rejected proposal's keys and values are left past the cache's length, overwritten next.

Drafters propose up to k tokens given the sequence so far: PromptLookup (the longest recent n-gram of
prompt + output that recurs proposes what followed it). The number proposed adapts to how many were
accepted and what passes cost (Pacer), so text that does not repeat costs little more than plain decoding."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .errors import QliteError
from .generate import INITIAL_NEW_TOKENS

MAX_DRAFT = 7  # proposals per pass: the verify forward's rows (1 + 7) stay in the matrix-vector kernels (native.MAX_ROWS)


class PromptLookup:
    """Proposes the continuation of the most recent earlier occurrence of the sequence's last n tokens,
    for the longest n from max_ngram down to min_ngram that has one (prompt lookup decoding, Saxena 2023;
    llama.cpp's llama-lookup, transformers' prompt_lookup_num_tokens)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: list[int], k: int) -> list[int]:
        n_tokens = len(tokens)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            tail = tokens[n_tokens - n:]
            for i in range(n_tokens - n - 1, -1, -1):  # most recent first; the tail itself excluded
                if tokens[i:i + n] == tail:
                    return tokens[i + n:i + n + k]
        return []


class Pacer:
    """How many tokens to propose: the k that maximises the tokens a pass is expected to yield,
    1 + a + ... + a^k (a: the chance that a proposal is taken once the ones before it were, a running
    estimate), over what a pass of 1 + k rows costs (a running mean of measured pass times per row
    count; until measured, a step plus ROW_COST of a step per extra row). Text that does not repeat
    drives a, and so k, down to 0 (plain steps), with one proposal every PROBE passes to see whether
    that changed."""
    ROW_COST = 0.35  # an extra verify row's share of a step, before measured (the demo model, int4, 2 Zen 4 cores)
    DECAY = 0.8  # weight of the past in the running estimates
    PROBE = 8

    def __init__(self, most: int = MAX_DRAFT, taken: float = 0.8):
        self.most, self.taken = most, taken
        self.seconds: dict[int, float] = {}  # rows -> running mean of a pass's seconds
        self.idle = 0  # passes since the last proposal

    def update(self, proposed: int, accepted: int) -> None:
        """After a pass: `accepted` of `proposed` taken (a rejection ends a pass's run)."""
        if proposed:
            tries = accepted + (accepted < proposed)
            self.taken = self.DECAY * self.taken + (1 - self.DECAY) * accepted / tries

    def timed(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds

    def cost(self, rows: int) -> float:
        if rows in self.seconds:
            return self.seconds[rows]
        step = self.seconds.get(1, 1.0)
        return step * (1 + self.ROW_COST * (rows - 1))

    def best(self) -> int:
        """The k of the most tokens per second expected."""
        gains, tokens, best, best_k = 1.0, 1.0, 0.0, 0
        for k in range(0, self.most + 1):
            if k:
                gains *= self.taken
                tokens += gains
            rate = tokens / self.cost(1 + k)
            if rate > best:
                best, best_k = rate, k
        return best_k

    def next(self) -> int:
        """How many to propose for the coming pass."""
        k = self.best()
        self.idle = 0 if k else self.idle + 1
        if self.idle >= self.PROBE:
            k, self.idle = 1, 0
        return k


@dataclass
class Stats:
    passes: int = 0  # forwards after the prompt's
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0

    def __str__(self) -> str:
        rate = self.accepted / self.proposed if self.proposed else 0.0
        per_pass = self.tokens / max(self.passes + 1, 1)
        return (f"speculation: {self.accepted}/{self.proposed} proposed tokens accepted ({rate:.0%}), "
                f"{per_pass:.2f} tokens per forward")


@dataclass
class Speculation:
    """What `--speculate` and `--draft-tokens` ask for, and what it did (stats, over every decode)."""
    drafter: PromptLookup
    most: int = MAX_DRAFT
    stats: Stats = field(default_factory=Stats)

    @classmethod
    def named(cls, spec: str, model, most: int = MAX_DRAFT) -> "Speculation":
        """--speculate lookup (a draft model's dir: not built yet, a clear error)."""
        if spec != "lookup":
            raise QliteError(f"--speculate {spec}: only 'lookup' (prompt lookup) is built; draft models are not yet")
        if not 1 <= most <= MAX_DRAFT:
            raise QliteError(f"--draft-tokens {most}: from 1 to {MAX_DRAFT}")
        check_exact(model)
        return cls(PromptLookup(), most)

    def decode(self, model, prompt: list[int], seq) -> Iterator[tuple[int, list]]:
        return decode_speculative(model, prompt, seq, self.drafter, self.most, self.stats)


def speculation(spec: str | None, model, most: int = MAX_DRAFT) -> Speculation | None:
    """--speculate / speculate=: a Speculation, or None when not asked for."""
    return None if spec is None else Speculation.named(spec, model, most)


def check_exact(model) -> None:
    """Speculation's output equals plain decoding's only where the verify forward is row-exact: every
    linear on a native product and the native small ops (CPU, bf16)."""
    from . import native
    from .backends import NativeOps

    ops = {m.ops for m in model.modules() if hasattr(m, "ops")}
    kernels = [getattr(m, "kernel", None) for m in model.modules() if hasattr(m, "kernel")]
    if ops != {NativeOps} or native.library() is None or any(getattr(k, "product", None) is None for k in kernels):
        raise QliteError("--speculate: needs qlite's native CPU kernels for every layer (--kernel auto or native, "
                         "a bf16 CPU run), whose verify pass gives the very logits of plain decoding")


@torch.inference_mode()
def decode_speculative(model, prompt: list[int], seq, drafter, most: int = MAX_DRAFT, stats: Stats | None = None
                       ) -> Iterator[tuple[int, list]]:
    """decode.decode_batch for one sequence, with proposals from `drafter` verified `most` at a time at
    most: yields (token taken, its events) until the sequence ends."""
    context = model.config.context_length
    if not prompt:
        raise QliteError("empty prompt")
    if len(prompt) >= context:
        raise QliteError(f"prompt is {len(prompt)} tokens, the model's context is {context}")
    capacity = min(context, len(prompt) + seq.params.max_new_tokens)
    cache = model.new_cache(1, min(capacity, len(prompt) + INITIAL_NEW_TOKENS), limit=capacity)
    stats, pacer, tokens = stats or Stats(), Pacer(min(most, MAX_DRAFT)), list(prompt)
    out, draft, start = model(torch.tensor([prompt], device=model.device), cache, last_only=True)[0], [], 0  # (1, V)
    while True:
        top, finite = model.ops.argmax_rows(out)
        taken = accepted = 0
        for j in range(out.shape[0]):  # out[j]: the logits after feed[j]; draft[j] proposed for there
            events = seq.take(seq.pick(out[j], finite[j], top[j]))
            tokens.append(seq.token)
            taken, accepted = taken + 1, accepted + (j < len(draft) and seq.token == draft[j])
            if len(tokens) >= capacity and not seq.finished:  # the context is full
                events += seq.end("length")
            yield seq.token, events
            if seq.finished or j == len(draft) or seq.token != draft[j]:
                break
        stats.tokens += taken
        if draft:
            stats.proposed, stats.accepted = stats.proposed + len(draft), stats.accepted + accepted
            pacer.update(len(draft), accepted)
            cache.length = start + taken  # the fed tokens that were taken; the rest is overwritten next
        if seq.finished:
            return
        # the last token the context or the budget allows is picked whatever was proposed for it
        k = min(pacer.next(), capacity - len(tokens) - 1, seq.params.max_new_tokens - seq.generated - 1)
        draft = drafter.propose(tokens, k) if k > 0 else []
        feed, start = torch.tensor([[seq.token, *draft]], device=model.device), cache.length
        t0 = time.perf_counter()
        out = model(feed, cache, exact=bool(draft))[0]  # (1 + len(draft), V)
        pacer.timed(feed.shape[1], time.perf_counter() - t0)
        stats.passes += 1
