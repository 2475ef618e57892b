"""Continuous batching: one thread owns the model; every decode step runs all active sequences at
once (one forward, each sequence with its own position, sampling settings and random generator),
new sequences are prefilled together (one left-padded forward for those waiting, bounded by
PREFILL_TOKENS) and join between steps, finished or abandoned ones leave.

The KV cache is allocated once for --max-batch rows of --ctx tokens, so a full server queues (and
past --max-queue refuses) but never grows. Rows share one write index t, as in generate_tokens'
left-padded batches: active row i holds its tokens at [start_i, t) (key_mask), every step writes
each row's new token at t. A sequence joining with L prompt tokens is placed at [t - L, t) (the
cache shifted right first if t < L); when t reaches the end, all rows shift left by the smallest
start. Active rows are rows 0..B-1 (a leaving row is replaced by the last one), so a step's cache is
a view of the first B rows. One active row alone is kept at start 0, so it takes the same path as
`qlite generate` (no mask).
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .errors import QliteError
from .generate import NON_FINITE, SamplingParams, StopText, left_padded, next_token
from .memory import release_freed_memory

PREFILL_TOKENS = 2048  # new prompts prefill together while (group size) x (longest) stays within this

# ("start", prompt_tokens) | ("text", piece) | ("done", finish_reason, completion_tokens) | ("error", msg, http status)
Event = tuple


def prefill_groups(ready: list[tuple]) -> list[list[tuple]]:
    """Split (job, ids, max_tokens) in arrival order into groups that prefill as one padded batch:
    a group grows while its size times its longest prompt stays within PREFILL_TOKENS (so padding
    and activations stay bounded); a longer prompt goes alone."""
    groups: list[list[tuple]] = []
    longest = 0
    for item in ready:
        L = len(item[1])
        if groups and max(longest, L) * (len(groups[-1]) + 1) <= PREFILL_TOKENS:
            groups[-1].append(item)
            longest = max(longest, L)
        else:
            groups.append([item])
            longest = L
    return groups


@dataclass
class Job:
    """One request: `prepare` (run on the engine thread: templates render there) gives the prompt
    ids; events go to `emit` (thread-safe); set `cancelled` to abandon it (a client that left)."""
    prepare: Callable[[], list[int]]
    params: SamplingParams  # max_new_tokens: the request's max_tokens, or None-like 0 for "to the context"
    emit: Callable[[Event], None]
    max_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    cancelled: bool = False


@dataclass
class Sequence:
    job: Job
    params: SamplingParams
    text: StopText
    position: int  # the position of the token to feed next
    token: int = -1  # the token to feed next
    generated: int = 0
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = None  # (1, V) bool, for the repetition penalty
    counts: torch.Tensor | None = None  # (V,) float, for presence / frequency penalties
    finished: bool = False


@dataclass
class Engine:
    lm: object  # pipeline.TextModel
    max_batch: int = 8
    ctx: int = 4096
    max_queue: int = 64
    rows: list = field(default_factory=list)

    def __post_init__(self):
        model = self.lm.model
        self.ctx = min(self.ctx, model.config.max_position_embeddings)
        self.cache = model.new_cache(self.max_batch, self.ctx, limit=self.ctx)
        self.key_mask = torch.zeros((self.max_batch, self.ctx), dtype=torch.bool, device=model.device)
        self.waiting: collections.deque[Job] = collections.deque()
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="qlite-engine", daemon=True)

    # --- the outside ---
    def start(self) -> "Engine":
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join()

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (the caller answers 503): more than max_queue
        jobs would wait beyond the free rows of the batch."""
        with self.wake:
            if len(self.waiting) - (self.max_batch - len(self.rows)) >= self.max_queue:
                return False
            self.waiting.append(job)
            self.wake.notify()
            return True

    def load(self) -> dict:
        return {"active": len(self.rows), "waiting": len(self.waiting), "max_batch": self.max_batch, "ctx": self.ctx}

    # --- the engine thread ---
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self.wake:
                    if not self.stopping and not self.waiting and not self.rows:
                        release_freed_memory()  # idle: the heap that requests used goes back to the OS
                    while not self.stopping and not self.waiting and not self.rows:
                        self.wake.wait()
                    if self.stopping:
                        break
                try:
                    self._admit()
                    if self.rows:
                        self._step()
                except Exception as e:  # a bug in a shared step must not hang every client: fail the active ones, go on
                    for seq in self.rows:
                        seq.job.emit(("error", f"internal error: {type(e).__name__}: {e}", 500))
                    self.rows.clear()
                    self.key_mask.zero_()
                    self.cache.length = 0
        for seq in self.rows:
            seq.job.emit(("error", "the server is shutting down", 503))

    def _next_job(self, admitted: int) -> Job | None:
        with self.wake:
            return self.waiting.popleft() if self.waiting and len(self.rows) + admitted < self.max_batch else None

    def _admit(self) -> None:
        """Take waiting jobs while rows are free; prefill them in groups (one forward per group)."""
        ready: list[tuple[Job, list[int], int]] = []
        while (job := self._next_job(len(ready))) is not None:
            if job.cancelled:
                continue
            try:
                ids = job.prepare()
                if not ids:
                    raise QliteError("the prompt is empty")
                room = self.ctx - len(ids)
                if room < 1:
                    raise QliteError(f"the prompt is {len(ids)} tokens, the context is {self.ctx}")
                if job.max_tokens is not None and job.max_tokens > room:
                    raise QliteError(f"max_tokens {job.max_tokens}: the prompt is {len(ids)} tokens and the "
                                     f"context {self.ctx}, so at most {room} can follow")
            except QliteError as e:
                job.emit(("error", str(e), 400))
                continue
            except Exception as e:  # this request's own failure (its template, its text): never another's
                job.emit(("error", f"internal error: {type(e).__name__}: {e}", 500))
                continue
            job.emit(("start", len(ids)))
            ready.append((job, ids, job.max_tokens or room))
        for group in prefill_groups(ready):
            rows = len(self.rows)
            try:
                self._prefill(group)
            except Exception as e:  # the group's own forward failed before it joined: only its jobs fail
                del self.rows[rows:]
                self.key_mask[rows:] = False
                for job, _, _ in group:
                    job.emit(("error", f"internal error: {type(e).__name__}: {e}", 500))

    def _prefill(self, group: list[tuple[Job, list[int], int]]) -> None:
        """Prefill new sequences as one left-padded batch, then place them in the free rows: each
        row's tokens at [t - L_i, t) of the shared cache."""
        model, dev, vocab = self.lm.model, self.lm.model.device, self.lm.model.config.vocab_size
        seqs = []
        for job, ids, max_tokens in group:
            params = replace(job.params, max_new_tokens=max_tokens)
            seq = Sequence(job, params, StopText(self.lm.tokenizer, params.stop), position=len(ids))
            if params.seed is not None:
                seq.generator = torch.Generator(device=dev).manual_seed(params.seed)
            if params.repetition_penalty != 1.0:
                seq.seen = torch.zeros((1, vocab), dtype=torch.bool, device=dev)
                seq.seen[0, torch.tensor(ids, device=dev)] = True
            if job.presence_penalty or job.frequency_penalty:
                seq.counts = torch.zeros(vocab, device=dev)
            seqs.append(seq)
        n, L = len(group), max(len(ids) for _, ids, _ in group)
        ids, mask, positions = left_padded([ids for _, ids, _ in group], L, device=dev)
        alone = model.new_cache(n, L)
        padded = not bool(mask.all())
        logits = model(ids, alone, positions, mask if padded else None, last_only=True)
        B, t = len(self.rows), self.cache.length
        if B == 0:
            t = self.cache.length = 0
        if t < L:
            self._shift(L - t)
            t = L
        if t >= self.ctx:
            t = self._compact()
        self.cache.k[:, B:B + n, :, t - L:t] = alone.k[:, :, :, :L]
        self.cache.v[:, B:B + n, :, t - L:t] = alone.v[:, :, :, :L]
        self.key_mask[B:B + n] = False
        self.key_mask[B:B + n, t - L:t] = mask
        self.rows.extend(seqs)
        argmax, finite = self.lm.model.ops.argmax_rows(logits[:, -1])
        for i, seq in enumerate(seqs):
            self._sample(seq, logits[i, -1], finite[i], argmax[i])
        self._retire()

    def _step(self) -> None:
        B = len(self.rows)
        if B == 1 and not bool(self.key_mask[0, 0]):
            self._compact()  # alone at start 0: the single-sequence path
        if self.cache.length >= self.ctx:
            self._compact()
        t, dev = self.cache.length, self.lm.model.device
        ids = torch.tensor([[s.token] for s in self.rows], device=dev)
        positions = torch.tensor([[s.position] for s in self.rows], device=dev)
        self.key_mask[:B, t] = True
        plain = bool(self.key_mask[:B, :t + 1].all())
        view = self.cache.first_rows(B)
        logits = self.lm.model(ids, view, positions, None if plain else self.key_mask[:B, :t + 1], last_only=True)
        self.cache.length = t + 1
        rows = logits[:, -1]  # (B, V)
        argmax, finite = self.lm.model.ops.argmax_rows(rows)
        for i, seq in enumerate(self.rows):
            seq.position += 1
            self._sample(seq, rows[i], finite[i], argmax[i])
        self._retire()

    def _sample(self, seq: Sequence, logits: torch.Tensor, finite: bool, argmax: int) -> None:
        """_pick, a failure of which ends this sequence alone."""
        try:
            self._pick(seq, logits, finite, argmax)
        except Exception as e:
            self._finish(seq, error=f"internal error: {type(e).__name__}: {e}")

    def _pick(self, seq: Sequence, logits: torch.Tensor, finite: bool, argmax: int) -> None:
        """Pick the next token of one sequence from its logits (V,) (finite and argmax: what
        ops.argmax_rows found for them) and emit its text."""
        job = seq.job
        if job.cancelled:
            seq.finished = True
            return
        if not finite:
            return self._finish(seq, error=f"{NON_FINITE} (at generated token {seq.generated + 1})")
        if seq.params.greedy and seq.counts is None and seq.params.repetition_penalty == 1.0:
            token = argmax
        else:
            logits = logits.float()[None]  # (1, V)
            if seq.counts is not None:
                logits = logits - job.frequency_penalty * seq.counts - job.presence_penalty * (seq.counts > 0).float()
            try:
                token = int(next_token(logits, seq.params, seq.seen, seq.generator)[0])
            except QliteError as e:
                return self._finish(seq, error=str(e))
        seq.generated += 1
        seq.token = token
        if seq.seen is not None:
            seq.seen[0, token] = True
        if seq.counts is not None:
            seq.counts[token] += 1
        if token in self.lm.eos_ids:
            return self._finish(seq, "stop")
        piece = seq.text.push(token)
        if piece:
            job.emit(("text", piece))
        if seq.text.stopped:
            return self._finish(seq, "stop")
        if seq.generated >= seq.params.max_new_tokens:
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str = "stop", error: str | None = None) -> None:
        seq.finished = True
        if error is not None:
            seq.job.emit(("error", error, 500))
            return
        piece = seq.text.flush()
        if piece:
            seq.job.emit(("text", piece))
        seq.job.emit(("done", reason, seq.generated))

    def _retire(self) -> None:
        """Drop finished rows: the last active row moves into each freed one."""
        i, t = 0, self.cache.length
        while i < len(self.rows):
            if not (self.rows[i].finished or self.rows[i].job.cancelled):
                i += 1
                continue
            last = len(self.rows) - 1
            if i != last:
                self.cache.k[:, i, :, :t] = self.cache.k[:, last, :, :t]
                self.cache.v[:, i, :, :t] = self.cache.v[:, last, :, :t]
                self.key_mask[i] = self.key_mask[last]
                self.rows[i] = self.rows[last]
            self.key_mask[last] = False
            self.rows.pop()
        if not self.rows:
            self.cache.length = 0

    def _shift(self, d: int) -> None:
        """Move every active row's tokens d places right (room for a longer prompt)."""
        B, t = len(self.rows), self.cache.length
        for buf in (self.cache.k, self.cache.v):
            buf[:, :B, :, d:d + t] = buf[:, :B, :, :t].clone()
        self.key_mask[:B, d:d + t] = self.key_mask[:B, :t].clone()
        self.key_mask[:B, :d] = False
        self.cache.length = t + d

    def _compact(self) -> int:
        """Move every active row's tokens left by the smallest start; the new write index."""
        B, t = len(self.rows), self.cache.length
        starts = [int(self.key_mask[i, :t].nonzero()[0]) if bool(self.key_mask[i, :t].any()) else t for i in range(B)]
        m = min(starts, default=t)
        if m:
            for buf in (self.cache.k, self.cache.v):
                buf[:, :B, :, :t - m] = buf[:, :B, :, m:t].clone()
            self.key_mask[:B, :t - m] = self.key_mask[:B, m:t].clone()
            self.key_mask[:B, t - m:] = False
            self.cache.length = t - m
        return self.cache.length
