"""One decoding step, shared by `qlite generate`, `qlite chat`, the Python API, the eval's batched
generation and the server's engine: a Sequence holds one sequence's state (sampling settings, seeded
generator, penalties, stop strings, end-of-sequence tokens, token budget) and turns the logits of its
next position into a token and events; RowCache keeps sequences as rows of one shared KV cache. What
differs between the callers is only scheduling: which forward runs when (generate.py, engine.py)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .errors import QliteError
from .generate import INITIAL_NEW_TOKENS, NON_FINITE, SamplingParams, StopText, left_padded, next_token


# --- events: what a sequence tells its caller ---------------------------------------------------

@dataclass(frozen=True)
class Start:
    prompt_tokens: int
    cached_tokens: int = 0  # of them, the ones whose keys and values came from the server's prompt cache


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Token:
    """A token taken, with its log-probability under the model's own logits and the `top` most likely
    tokens' ((id, logprob), ...): only where Shaping.logprobs asks for them."""
    id: int
    logprob: float
    top: tuple


@dataclass
class Shaping:
    """What a request adds to SamplingParams: OpenAI's presence/frequency penalties and logit_bias
    ({token id: added to its logit}), a grammar the tokens must follow (constrain.Constraint: one
    sequence's), and logprobs to report (None: none; n: each token's and the n most likely)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    constraint: object = None
    logprobs: int | None = None


@dataclass(frozen=True)
class Done:
    reason: str  # "stop" (eos or a stop string) or "length"
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500  # the HTTP status a server answers with
    code: str | None = None  # OpenAI's error code, where it has one (context_length_exceeded)


Event = Start | Text | Token | Done | Failed


class Sequence:
    """One sequence being decoded. `step(logits, finite, argmax)` picks its next token from the logits
    (V,) of its last position (finite and argmax: what ops.argmax_rows found for them, so greedy costs
    no second pass) and returns the events it makes; `token` is then the token to feed next. Without
    a tokenizer it makes no text (token-level callers), and stop strings do not apply."""

    def __init__(self, prompt: list[int], params: SamplingParams, eos_ids, tokenizer=None, device="cpu",
                 vocab_size: int | None = None, shaping: Shaping | None = None):
        shaping = shaping or Shaping()
        self.params, self.eos, self.constraint, self.logprobs = params, frozenset(eos_ids), shaping.constraint, \
            shaping.logprobs
        self.text = StopText(tokenizer, params.stop) if tokenizer is not None else None
        # the token to feed next and its position: the prompt's last (its logits give the first token), then each taken
        self.position, self.token, self.generated = len(prompt) - 1, prompt[-1] if prompt else -1, 0
        self.history, self.failed = list(prompt), False  # prompt and tokens taken
        self.presence, self.frequency = shaping.presence_penalty, shaping.frequency_penalty
        self.bias = self.scored = None
        if shaping.logit_bias:
            self.bias = torch.zeros(vocab_size, device=device)  # (V,)
            self.bias[torch.tensor(list(shaping.logit_bias), device=device)] = torch.tensor(
                list(shaping.logit_bias.values()), device=device, dtype=torch.float32)
        self.generator = torch.Generator(device=device).manual_seed(params.seed) if params.seed is not None else None
        self.seen = self.counts = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros((1, vocab_size), dtype=torch.bool, device=device)  # (1, V)
            self.seen[0, torch.tensor(prompt, device=device)] = True
        if self.presence or self.frequency:
            self.counts = torch.zeros(vocab_size, device=device)  # (V,)
        self.finished = False

    @property
    def plain_greedy(self) -> bool:
        return self.params.greedy and self.seen is None and self.counts is None

    def pick(self, logits: torch.Tensor, finite: bool, argmax: int) -> int:
        """The next token (raises QliteError for non-finite logits or a sampling failure)."""
        if not finite:
            raise QliteError(f"{NON_FINITE} (at generated token {self.generated + 1})")
        if self.logprobs is not None:
            self.scored = logits  # (V,): the model's own, for take's Token event
        if self.bias is not None:
            logits = logits.float() + self.bias
            argmax = int(logits.argmax())
        if self.constraint is not None:
            logits = self.constraint.mask(logits)  # (V,) float32, -inf where the grammar says no
            argmax = int(logits.argmax())
        if self.plain_greedy:
            return argmax
        logits = logits.float()[None]  # (1, V)
        if self.counts is not None:
            logits = logits - self.frequency * self.counts - self.presence * (self.counts > 0).float()
        return int(next_token(logits, self.params, self.seen, self.generator)[0])

    def step(self, logits: torch.Tensor, finite: bool, argmax: int) -> list[Event]:
        """Pick and take the next token; a failure ends this sequence alone (a Failed event)."""
        try:
            return self.take(self.pick(logits, finite, argmax))
        except QliteError as e:  # a grammar's failure is the request's schema's: its status says so
            return self.fail(str(e), getattr(e, "status", 500), getattr(e, "code", None))

    def take(self, token: int) -> list[Event]:
        """Append a token: its text, and the end at an eos, a stop string or the token budget."""
        if self.constraint is not None:
            self.constraint.take(token)
        self.history.append(token)
        self.generated += 1
        self.token = token
        self.position += 1
        if self.seen is not None:
            self.seen[0, token] = True
        if self.counts is not None:
            self.counts[token] += 1
        if token in self.eos:
            return self.end("stop")
        events = [] if self.scored is None else [self.scored_token(token)]
        if self.text is not None:
            piece = self.text.push(token)
            if piece:
                events.append(Text(piece))
            if self.text.stopped:
                return events + self.end("stop")
        if self.generated >= self.params.max_new_tokens:
            return events + self.end("length")
        return events

    def scored_token(self, token: int) -> Token:
        logprobs = torch.log_softmax(self.scored.float(), -1)  # (V,)
        top = logprobs.topk(self.logprobs) if self.logprobs else None
        self.scored = None
        return Token(token, float(logprobs[token]),
                     () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist())))

    def end(self, reason: str) -> list[Event]:
        """Finish: the text held back (for a stop string that did not come), then Done."""
        self.finished = True
        piece = self.text.flush() if self.text is not None else ""
        return ([Text(piece)] if piece else []) + [Done(reason, self.generated)]

    def fail(self, message: str, status: int = 500, code: str | None = None) -> list[Event]:
        self.finished = self.failed = True
        return [Failed(message, status, code)]


class RowCache:
    """Sequences as rows of one KV cache sharing a write index t (cache.length): active row i holds its
    tokens at [start_i, t) (key_mask), rows 0..B-1 are the active ones. Rows join with a prefilled cache
    of their own, leave (the last row moves into the freed one), and the tokens shift right (room for a
    longer prompt) or left (when t reaches the end). The cache grows (doubling) as t does, up to ctx:
    memory follows the longest row, not rows x ctx."""
    INITIAL = 256  # tokens a row has room for before the cache first grows

    def __init__(self, model, rows: int, ctx: int):
        self.cache = model.new_cache(rows, min(ctx, self.INITIAL), limit=ctx)
        self.key_mask = torch.zeros((rows, ctx), dtype=torch.bool, device=model.device)
        self.ctx, self.active = ctx, 0

    @property
    def t(self) -> int:
        return self.cache.length

    def clear(self) -> None:
        self.key_mask.zero_()
        self.cache.length = self.active = 0

    def join(self, alone, mask: torch.Tensor) -> None:
        """Place n prefilled rows (their cache `alone` holds L tokens, left-padded as `mask` (n, L) says)
        after the active ones, at [t - L, t)."""
        n, L = mask.shape
        B, t = self.active, self.t
        if B == 0:
            t = self.cache.length = 0
        if t < L:
            self.shift(L - t)
            t = L
        if t >= self.ctx:
            t = self.compact()
        self.cache.reserve(t)
        self.cache.k[:, B:B + n, :, t - L:t] = alone.k[:, :, :, :L]
        self.cache.v[:, B:B + n, :, t - L:t] = alone.v[:, :, :, :L]
        self.key_mask[B:B + n] = False
        self.key_mask[B:B + n, t - L:t] = mask
        self.active = B + n

    def drop_after(self, rows: int) -> None:
        """Forget rows past the first `rows` (a group whose prefill failed)."""
        self.key_mask[rows:] = False
        self.active = min(self.active, rows)

    def leave(self, i: int) -> None:
        """Row i leaves: the last active row moves into it."""
        last, t = self.active - 1, self.t
        if i != last:
            self.cache.k[:, i, :, :t] = self.cache.k[:, last, :, :t]
            self.cache.v[:, i, :, :t] = self.cache.v[:, last, :, :t]
            self.key_mask[i] = self.key_mask[last]
        self.key_mask[last] = False
        self.active = last
        if not self.active:
            self.cache.length = 0

    def next_step(self, tokens: int = 1) -> tuple[object, torch.Tensor | None]:
        """Make room for one token per active row at t (and for `tokens` in all: a speculative pass's): (the
        cache view of the active rows, their key mask up to t + 1, or None when no row has padding: the
        single-sequence path)."""
        B = self.active
        if B == 1 and not bool(self.key_mask[0, 0]):
            self.compact()  # alone at start 0: the single-sequence path
        if self.t + tokens > self.ctx:
            self.compact()
        t = self.t
        self.cache.reserve(t + tokens)
        self.key_mask[:B, t] = True
        plain = bool(self.key_mask[:B, :t + 1].all())
        return self.cache.first_rows(B), None if plain else self.key_mask[:B, :t + 1]

    def stepped(self) -> None:
        self.cache.length += 1

    def shift(self, d: int) -> None:
        """Move every active row's tokens d places right."""
        B, t = self.active, self.t
        self.cache.reserve(t + d)
        for buf in (self.cache.k, self.cache.v):
            buf[:, :B, :, d:d + t] = buf[:, :B, :, :t].clone()
        self.key_mask[:B, d:d + t] = self.key_mask[:B, :t].clone()
        self.key_mask[:B, :d] = False
        self.cache.length = t + d

    def compact(self) -> int:
        """Move every active row's tokens left by the smallest start; the new write index."""
        B, t = self.active, self.t
        starts = [int(self.key_mask[i, :t].nonzero()[0]) if bool(self.key_mask[i, :t].any()) else t for i in range(B)]
        m = min(starts, default=t)
        if m:
            for buf in (self.cache.k, self.cache.v):
                buf[:, :B, :, :t - m] = buf[:, :B, :, m:t].clone()
            self.key_mask[:B, :t - m] = self.key_mask[:B, m:t].clone()
            self.key_mask[:B, t - m:] = False
            self.cache.length = t - m
        return self.t


# --- the decode loop of one left-padded batch (generate, chat, the Python API, the eval) -------------

@torch.inference_mode()
def decode_batch(model, prompts: list[list[int]], seqs: list[Sequence]
                 ) -> Iterator[list[tuple[int | None, list[Event]]]]:
    """Prefill the prompts as one left-padded batch, then step every unfinished sequence until all have
    ended (at an eos, a stop string, the token budget or the model's context; the cache grows as
    tokens come). Yields, each step, every row's (token taken, or None once ended; its events).
    Non-finite logits raise QliteError."""
    context = model.config.context_length
    if not prompts or any(len(p) == 0 for p in prompts):
        raise QliteError("empty prompt")
    B, L = len(prompts), max(len(p) for p in prompts)
    if L >= context:
        raise QliteError(f"prompt is {L} tokens, the model's context is {context}")
    capacity = min(context, L + max(s.params.max_new_tokens for s in seqs))
    dev = model.device
    ids, key_mask, positions = left_padded(prompts, capacity, 0, dev)
    padded = not bool(key_mask[:, :L].all())
    cache = model.new_cache(B, min(capacity, L + INITIAL_NEW_TOKENS), limit=capacity)  # grows as tokens come
    logits = model(ids, cache, positions, key_mask[:, :L] if padded else None, last_only=True)
    next_pos = positions[:, -1:] + 1  # (B, 1)
    for step in range(capacity - L):
        top, finite = model.ops.argmax_rows(logits[:, -1])
        rows = []
        for i, s in enumerate(seqs):
            if s.finished:
                rows.append((None, []))
                continue
            events = s.take(s.pick(logits[i, -1], finite[i], top[i]))
            if step == capacity - L - 1 and not s.finished:  # the context is full
                events += s.end("length")
            rows.append((s.token, events))
        yield rows
        if all(s.finished for s in seqs):
            return
        key_mask[:, L + step] = True
        token = torch.tensor([[s.token] for s in seqs], device=dev)  # an ended row's output is not read
        logits = model(token, cache, next_pos, key_mask[:, :L + step + 1] if padded else None, last_only=True)
        next_pos = next_pos + 1


def generate_tokens(model, prompts: list[list[int]], params: SamplingParams, eos_ids,
                    pad_id: int = 0) -> Iterator[torch.Tensor]:
    """Yield the next token of every prompt (B,) each step; a row that has ended yields pad_id.
    Prompts of different lengths are left-padded and masked. Ends at an eos in every row, at
    max_new_tokens, or at the model's context limit."""
    seqs = [Sequence(p, params, eos_ids, None, model.device, model.config.vocab_size) for p in prompts]
    for rows in decode_batch(model, prompts, seqs):
        yield torch.tensor([pad_id if token is None else token for token, _ in rows], device=model.device)


def stream_text(model, tokenizer, prompt_ids: list[int], params: SamplingParams, eos_ids,
                on_token=None, speculation=None, constraint=None) -> Iterator[str]:
    """Yield the completion's text as it is generated, ending before any eos or stop string.
    on_token, if given, is called with each generated token id (for counting). speculation: a
    speculate.Speculation (the same text, fewer forwards); constraint: a constrain.Constraint."""
    seq = Sequence(prompt_ids, params, eos_ids, tokenizer, model.device, model.config.vocab_size,
                   Shaping(constraint=constraint))
    steps = (((token, events) for [(token, events)] in decode_batch(model, [prompt_ids], [seq]))
             if speculation is None else speculation.decode(model, prompt_ids, seq))
    for token, events in steps:
        if on_token is not None:
            on_token(token)
        yield from (e.text for e in events if isinstance(e, Text))


def detokenize(tokens: Iterable[int], tokenizer, eos_ids, stop: tuple[str, ...] = ()) -> Iterator[str]:
    """Text pieces for a stream of token ids, ending before the first eos or stop string (Sequence.take)."""
    seq = Sequence([0], SamplingParams(max_new_tokens=sys.maxsize, stop=stop), eos_ids, tokenizer)
    for t in tokens:
        for event in seq.take(t):
            if isinstance(event, Text):
                yield event.text
        if seq.finished:
            return
    yield from (e.text for e in seq.end("stop") if isinstance(e, Text))
