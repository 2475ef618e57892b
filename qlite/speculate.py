"""Speculative decoding, exact: a drafter proposes the next few tokens, one forward of the model over the
last token and the proposals (`exact=True`: each logit bitwise what one-token steps give, on the native
kernels) yields the model's own next token after each of them, and the proposals are taken while they
agree with it. Every token is still picked by the sequence from the model's own logits, in order, with
its own generator, so the output is the one plain decoding gives: greedy token for token, sampled
(temperature, top-k/p, penalties, seeds) draw for draw. (With a one-hot proposal, sampling x ~ p and
keeping the proposal iff x equals it is speculative sampling's accept-with-p(d), resample-from-the-
rest rule.) A rejected proposal's keys and values are left past the cache's length, overwritten next.

Drafters propose up to k tokens given the sequence so far: PromptLookup (the longest recent n-gram of
prompt + output that recurs proposes what followed it; where the sequence has no long match, an earlier
sequence's answer may: the model reuses its own phrases) and DraftModel (what another checkpoint with the
same tokenizer decodes greedily: a 4-bit mix drafting for an 8-bit model of the same weights is quantized
self-speculation). A drafter's proposals are one-hot, so a sampled run keeps plain decoding's very draws
(the min(1, p/q) rule with a draft model's full q would take more proposals, but other draws than plain
decoding's for a seed). The number proposed adapts to how many were accepted and what passes cost, the
drafting included (Pacer), so text that does not repeat costs little more than plain decoding."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .errors import QliteError
from .generate import INITIAL_NEW_TOKENS

MAX_DRAFT = 7  # proposals per pass: the verify forward's rows (1 + 7) stay in the matrix-vector kernels (native.MAX_ROWS)


class Drafter:
    """The drafters' interface: `propose(tokens, k)`, up to k tokens likely to follow `tokens`; `match(tokens)`,
    which kind of proposal is on offer (0: none), each kind's acceptance learnt on its own by the pacer;
    `for_sequence()`, the drafter for one sequence (a copy where it keeps state about the sequence);
    `remember(answer)`, a sequence's generated tokens once it ends."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def match(self, tokens: list[int]) -> int:
        return 1  # one kind of proposal, always on offer

    def for_sequence(self) -> "Drafter":
        return self

    def remember(self, answer: list[int]) -> None:
        """A sequence's generated tokens, once it ends (a drafter that learns from earlier answers keeps them)."""


class Answers:
    """Earlier sequences' generated tokens (the newest `most`, in order), with where each of their 3- to
    max_ngram-grams last ended: what a new sequence's tail may be continued by when its own history has no
    long match (the model answers in its own phrases: code's scaffolding, its explanations' headings;
    llama.cpp's lookup keeps such a "dynamic" n-gram cache too). Shared by every sequence of a Speculation
    (a server's requests): proposals are only proposals, the model's own tokens are what is taken. At most
    `most` tokens are kept (past it the older half goes, or more where a new answer needs the room): 2^15,
    some 16 MB of index."""
    END = -1
    MIN_NGRAM = 3  # shorter matches of other answers mislead more than they help (eval.benchmarks.pacing)

    def __init__(self, max_ngram: int = 5, most: int = 1 << 15):
        self.max_ngram, self.most = max_ngram, most
        self.tokens: list[int] = []  # the answers one after another, each followed by END
        self.ends: dict[tuple, int] = {}  # n-gram -> where its latest occurrence ends

    def add(self, answer: list[int]) -> None:
        if not answer or len(answer) + 1 > self.most:
            return
        over = len(self.tokens) + len(answer) + 1 - self.most
        if over > 0:  # keep the newest half, or less where the answer needs the room, indexed afresh
            self.tokens, self.ends = self.tokens[max(len(self.tokens) // 2, over):], {}
            self._index(0)
        base = len(self.tokens)
        self.tokens += [*answer, self.END]
        self._index(base)

    def _index(self, start: int) -> None:
        """Where each gram of tokens[start:] within one answer ends, those with a continuation in it."""
        for end in range(start + self.MIN_NGRAM, len(self.tokens)):
            if self.tokens[end] == self.END:
                continue
            for n in range(self.MIN_NGRAM, min(self.max_ngram, end - start) + 1):
                gram = tuple(self.tokens[end - n:end])
                if self.END in gram:
                    break
                self.ends[gram] = end

    def match(self, tokens: list[int]) -> tuple[int, int | None]:
        """(n, where its continuation starts) for the longest tail n-gram of tokens an answer had, else (0, None)."""
        for n in range(min(self.max_ngram, len(tokens)), self.MIN_NGRAM - 1, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return n, end
        return 0, None

    def after(self, end: int, k: int) -> list[int]:
        """Up to k tokens of the answer from `end` on."""
        ahead = self.tokens[end:end + k]
        return ahead[:ahead.index(self.END)] if self.END in ahead else ahead


class PromptLookup(Drafter):
    """Proposes the continuation of the most recent earlier occurrence of the sequence's last n tokens,
    for the longest n from max_ngram down to min_ngram that has one (prompt lookup decoding, Saxena 2023;
    llama.cpp's llama-lookup, transformers' prompt_lookup_num_tokens). Where each n-gram last ended is
    indexed as the sequence grows (one dict update per token and n), so a lookup costs as much at 30,000
    tokens as at 30; the index follows one token list (the sequence's history, which only grows), and
    starts again when given another. Where the sequence's own match is shorter than Answers.MIN_NGRAM (3),
    an earlier answer's (`answers`, shared by the sequences of one Speculation) is proposed instead: its
    kinds are ANSWER_KINDS + n, apart from the sequence's own (1 to max_ngram)."""
    ANSWER_KINDS = 10

    def __init__(self, max_ngram: int = 5, min_ngram: int = 1, answers: Answers | None = None):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.answers = answers if answers is not None else Answers(max_ngram)
        self.tokens: list[int] | None = None  # the list indexed, its first `indexed` tokens
        self.indexed, self.ends = 0, {}  # ends: n-gram -> where its latest occurrence ends
        self.earlier: dict[int, int | None] = {}  # n -> where the tail's n-gram ended before the tail, if it did
        self.answer_end = 0  # where the matched earlier answer's continuation starts

    def for_sequence(self) -> "PromptLookup":
        """A lookup of its own for one sequence (its index), the earlier answers shared."""
        return PromptLookup(self.max_ngram, self.min_ngram, self.answers)

    def remember(self, answer: list[int]) -> None:
        self.answers.add(answer)

    def match(self, tokens: list[int]) -> int:
        """What kind of proposal is on offer (0: none): the n of the longest tail n-gram that occurred before
        in the sequence, or ANSWER_KINDS + n for one in an earlier answer."""
        if tokens is not self.tokens or len(tokens) < self.indexed:
            self.tokens, self.indexed, self.ends, self.earlier = tokens, 0, {}, {}
        for end in range(self.indexed + 1, len(tokens) + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                gram = tuple(tokens[end - n:end])
                self.earlier[n] = self.ends.get(gram)
                self.ends[gram] = end
        self.indexed = len(tokens)
        own = next((n for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1)
                    if self.earlier.get(n) is not None), 0)
        if own < Answers.MIN_NGRAM:
            n, self.answer_end = self.answers.match(tokens)
            if n:
                return self.ANSWER_KINDS + n
        return own

    def propose(self, tokens: list[int], k: int) -> list[int]:
        n = self.match(tokens)
        if n > self.ANSWER_KINDS:
            return self.answers.after(self.answer_end, k)
        return tokens[self.earlier[n]:self.earlier[n] + k] if n else []


class DraftModel(Drafter):
    """Proposes the next k tokens as a draft model decodes them greedily, one step each, in its own KV
    cache of the sequence (kept between calls: each call rolls it back to what it shares with the sequence
    and feeds the rest in one forward: one drafter serves every sequence, one at a time, as speculation runs)."""

    def __init__(self, model, target_vocab: int | None = None):
        self.model, self.cache, self.fed = model, None, []  # fed: the tokens in the cache, in order
        self.seconds_per_token = 0.0  # what a proposal costs (the last call's), for the Pacer
        # vocabularies may differ past the shared tokenizer's ids (Qwen2.5 0.5B 151,936 rows, 7B 152,064): a
        # sequence holding a token the draft has no row for is not drafted; a proposal the model has none for ends one
        self.draft_vocab = model.config.vocab_size
        self.target_vocab = target_vocab or self.draft_vocab

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        start = time.perf_counter()
        drafts = self._propose(tokens, k)
        if drafts:
            self.seconds_per_token = (time.perf_counter() - start) / len(drafts)
        return drafts

    def _propose(self, tokens: list[int], k: int) -> list[int]:
        model, context = self.model, self.model.config.context_length
        k = min(k, context - len(tokens))
        if k <= 0:
            return []
        shared = 0
        for a, b in zip(self.fed, tokens[:-1]):  # the last token is fed again: its logits are needed
            if a != b:
                break
            shared += 1
        if self.draft_vocab < self.target_vocab and max(tokens[shared:]) >= self.draft_vocab:
            return []  # only what the draft has not read yet is checked: the history it holds was
        if self.cache is None:
            self.cache = model.new_cache(1, min(context, len(tokens) + k + INITIAL_NEW_TOKENS), limit=context)
        self.cache.length = shared
        feed, drafts = tokens[shared:], []
        while True:
            out = model(torch.tensor([feed], device=model.device), self.cache, last_only=True)[0]  # (1, V)
            token = int(model.ops.argmax_rows(out)[0][0])
            if token >= self.target_vocab:  # no row of the model's: the proposals end before it
                self.fed = tokens + drafts
                return drafts
            drafts.append(token)
            if len(drafts) == k:
                break
            feed = drafts[-1:]
        self.fed = tokens + drafts[:-1]
        return drafts


def draft_model(path: Path, tokenizer, vocab_size: int) -> DraftModel:
    """A draft model's dir, loaded (its own defaults: bf16, bf16 KV cache), its tokenizer checked to be
    `tokenizer` (the model's, whose embedding has vocab_size rows), whose every id both models have a row
    for."""
    from .config import load_config
    from .loader import load_model
    from .tokenizer import Tokenizer
    if not (path / "config.json").is_file():
        raise QliteError(f"--speculate {path}: 'lookup', or a draft model's checkpoint dir (no config.json there)")
    ours, theirs = tokenizer.tok.get_vocab(), Tokenizer(path).tok.get_vocab()
    if ours != theirs:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise QliteError(f"--speculate {path}: {path / 'tokenizer.json'} is not the model's tokenizer ({differ} "
                         "token entries differ): a draft model must share it")
    draft_vocab = load_config(path).vocab_size
    if tokenizer.tok.get_vocab_size() > min(vocab_size, draft_vocab):
        raise QliteError(f"--speculate {path}: the draft's vocab_size is {draft_vocab} and the model's {vocab_size}, "
                         f"but their tokenizer has {tokenizer.tok.get_vocab_size()} tokens: both must have a row for each")
    return DraftModel(load_model(path), vocab_size)


class Pacer:
    """How many tokens to propose: the k that maximises the tokens a pass is expected to yield,
    1 + a + ... + a^k (a: the chance that a proposal is taken once the ones before it were, a running
    estimate for each kind of proposal: prompt lookup's by the length of the n-gram matched, whose
    continuations are taken far more often when it is long), over what a pass of 1 + k rows costs (a running
    mean of measured pass times per row count; a row count not yet measured at the nearest measured one's
    cost per extra row, or before any, a step plus ROW_COST of a step per extra row plus what the drafter
    last took per proposal). Text that does not repeat drives a, and so k, down to 0
    (plain steps), with one proposal of that kind every PROBE passes to see whether that changed, unless
    passes cost so much that even proposals sure to be taken would not pay (a draft model as dear as the
    model: each probe costs its catching up as well)."""
    ROW_COST = 0.35  # an extra verify row's share of a step, before measured (the demo model, int4, 2 Zen 4 cores)
    DECAY = 0.8  # weight of the past in the running estimates
    PROBE = 8

    def __init__(self, most: int = MAX_DRAFT, taken: float = 0.8, drafter=None):
        self.most, self.prior, self.drafter = most, taken, drafter  # drafter.seconds_per_token, where it has one
        self.taken: dict[int, float] = {}  # kind -> running estimate of a (the prior until proposals are seen)
        self.seconds: dict[int, float] = {}  # rows -> running mean of a pass's seconds
        self.idle: dict[int, int] = {}  # kind -> passes on offer since the last proposal of it

    def update(self, proposed: int, accepted: int, kind: int = 1) -> None:
        """After a pass: `accepted` of `proposed` taken (a rejection ends a pass's run)."""
        if proposed:
            tries = accepted + (accepted < proposed)
            self.taken[kind] = self.DECAY * self.taken.get(kind, self.prior) + (1 - self.DECAY) * accepted / tries

    def timed(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds

    def cost(self, rows: int) -> float:
        """A pass of `rows` fed tokens: measured, else at the cost per extra row of the nearest row count
        measured (its drafting included), else the prior (ROW_COST, plus the drafter's last cost per proposal)."""
        if rows in self.seconds:
            return self.seconds[rows]
        step, measured = self.seconds.get(1, 1.0), [r for r in self.seconds if r > 1]
        if measured:
            near = min(measured, key=lambda r: (abs(r - rows), -r))  # a tie: the larger count
            return step + (self.seconds[near] - step) * (rows - 1) / (near - 1)
        return step * (1 + self.ROW_COST * (rows - 1)) + getattr(self.drafter, "seconds_per_token", 0.0) * (rows - 1)

    def best(self, taken: float | None = None, kind: int = 1) -> int:
        """The k of the most tokens per second expected (at acceptance `taken`, else kind's running one)."""
        a = self.taken.get(kind, self.prior) if taken is None else taken
        gains, tokens, best, best_k = 1.0, 1.0, 0.0, 0
        for k in range(0, self.most + 1):
            if k:
                gains *= a
                tokens += gains
            rate = tokens / self.cost(1 + k)
            if rate > best:
                best, best_k = rate, k
        return best_k

    def next(self, kind: int = 1) -> int:
        """How many of a `kind` on offer to propose for the coming pass: none until a plain step is timed (the
        measure of every other pass; a draft model, which always proposes, would otherwise never be weighed
        against it)."""
        if 1 not in self.seconds:
            return 0
        k = self.best(kind=kind)
        self.idle[kind] = 0 if k else self.idle.get(kind, 0) + 1
        if self.idle[kind] >= self.PROBE and self.best(taken=1.0):  # no probe where even sure proposals cannot pay
            k, self.idle[kind] = 1, 0
        return k


@dataclass
class Stats:
    passes: int = 0  # forwards whose logits gave tokens, the prompt's included
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0

    def __str__(self) -> str:
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return (f"speculation: {self.accepted}/{self.proposed} proposed tokens accepted ({rate:.0%}), "
                f"{self.tokens / max(self.passes, 1):.2f} tokens per forward")

    def usage(self) -> dict:
        """The server's usage extras."""
        return {"passes": self.passes, "proposed_tokens": self.proposed, "accepted_tokens": self.accepted,
                "tokens_per_pass": round(self.tokens / max(self.passes, 1), 3)}


class Speculator:
    """One sequence's speculation between forwards: the proposals fed with its next token, its pacer and
    its stats (the drafter reads the sequence's own history). A caller runs each pass as: `propose`, one
    forward of [token, *draft] (exact), `verify` its logits, `timed`; a plain step goes through `took`."""

    def __init__(self, drafter, most: int, stats: Stats | None = None, pacer: Pacer | None = None):
        self.drafter, self.stats = drafter.for_sequence(), stats if stats is not None else Stats()
        self.pacer = pacer or Pacer(min(most, MAX_DRAFT), drafter=drafter)  # a server's is shared by its requests
        self.draft: list[int] = []
        self.kind = 0  # of the proposals in draft

    def propose(self, seq, room: int) -> list[int]:
        """Up to `room` proposals for the coming pass of `seq` (as many of the kind on offer as the pacer says
        pay)."""
        self.kind = self.drafter.match(seq.history)
        k = min(self.pacer.next(self.kind), room) if self.kind else 0
        self.draft = self.drafter.propose(seq.history, k) if k > 0 else []
        return self.draft

    def verify(self, seq, out: torch.Tensor, ops, capacity: int) -> list[tuple[int, list]]:
        """The tokens the sequence takes from one forward's logits out (1 + len(draft), V): after the fed
        token, then after each proposal while the one picked there was the proposal. Each is (token, its
        events); the sequence ends with "length" where its tokens reach `capacity`."""
        top, finite = ops.argmax_rows(out)
        steps, accepted = [], 0
        for j in range(out.shape[0]):  # out[j]: the logits after feed[j]; draft[j] proposed for there
            events = seq.take(seq.pick(out[j], finite[j], top[j]))
            accepted += j < len(self.draft) and seq.token == self.draft[j]
            if len(seq.history) >= capacity and not seq.finished:  # the context is full
                events += seq.end("length")
            steps.append((seq.token, events))
            if seq.finished or j == len(self.draft) or seq.token != self.draft[j]:
                break
        self.stats.passes, self.stats.tokens = self.stats.passes + 1, self.stats.tokens + len(steps)
        if self.draft:
            self.stats.proposed, self.stats.accepted = self.stats.proposed + len(self.draft), self.stats.accepted + accepted
            self.pacer.update(len(self.draft), accepted, self.kind)
        return steps

    def timed(self, rows: int, seconds: float) -> None:
        """What a pass of `rows` fed tokens took, its drafting included."""
        self.pacer.timed(rows, seconds)

    def finish(self, seq) -> None:
        """The sequence has ended: its answer to the drafter, for the sequences after it."""
        self.drafter.remember(seq.history[len(seq.history) - seq.generated:])

    def took(self) -> None:
        """A plain step's token (a batched step, where this sequence proposed nothing), for the stats."""
        self.stats.passes, self.stats.tokens = self.stats.passes + 1, self.stats.tokens + 1


@dataclass
class Speculation:
    """What `--speculate` and `--draft-tokens` ask for, and what it did (stats, over every decode)."""
    drafter: Drafter
    most: int = MAX_DRAFT
    stats: Stats = field(default_factory=Stats)

    @classmethod
    def named(cls, spec: str, model, most: int = MAX_DRAFT, tokenizer=None) -> "Speculation":
        """--speculate lookup, or --speculate DRAFT_DIR (checked against the model's tokenizer)."""
        if not 1 <= most <= MAX_DRAFT:
            raise QliteError(f"--draft-tokens {most}: from 1 to {MAX_DRAFT}")
        check_exact(model)
        if spec == "lookup":
            return cls(PromptLookup(), most)
        if tokenizer is None:
            raise QliteError(f"--speculate {spec}: a draft model needs the model's tokenizer to check its own against")
        return cls(draft_model(Path(spec).expanduser(), tokenizer, model.config.vocab_size), most)

    def decode(self, model, prompt: list[int], seq) -> Iterator[tuple[int, list]]:
        return decode_speculative(model, prompt, seq, self.drafter, self.most, self.stats)


def speculation(spec: str | None, lm, most: int = MAX_DRAFT) -> Speculation | None:
    """--speculate / speculate=: a Speculation for the pipeline's TextModel lm, or None when not asked for."""
    return None if spec is None else Speculation.named(spec, lm.model, most, lm.tokenizer)


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
    spec = Speculator(drafter, most, stats)
    out, start = model(torch.tensor([prompt], device=model.device), cache, last_only=True)[0], 0  # (1, V)
    while True:
        steps = spec.verify(seq, out, model.ops, capacity)
        if spec.draft:
            cache.length = start + len(steps)  # the fed tokens that were taken; the rest is overwritten next
        yield from steps
        if seq.finished:
            spec.finish(seq)
            return
        # the last token the context or the budget allows is picked whatever was proposed for it
        t0 = time.perf_counter()  # a pass's cost: the drafting and the verify forward
        draft = spec.propose(seq, min(capacity - len(seq.history) - 1, seq.params.max_new_tokens - seq.generated - 1))
        feed, start = torch.tensor([[seq.token, *draft]], device=model.device), cache.length
        out = model(feed, cache, exact=bool(draft))[0]  # (1 + len(draft), V)
        spec.timed(feed.shape[1], time.perf_counter() - t0)
