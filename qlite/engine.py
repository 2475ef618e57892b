"""Continuous batching, scheduling only: one thread owns the model; every decode step runs all active
sequences at once (one forward), new sequences are prefilled together (one left-padded forward for
those waiting, bounded by PREFILL_TOKENS) and join between steps, finished or abandoned ones leave.
Each sequence's token, text and end are decode.Sequence's (the step `qlite generate` takes too), and
its KV rows decode.RowCache's: allocated once for --max-batch rows of --ctx tokens, so a full server
queues (and past --max-queue refuses) but never grows. One active row alone is kept at start 0, so it
takes the same path as `qlite generate` (no mask).
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .decode import Event, Failed, RowCache, Sequence, Start
from .errors import QliteError
from .generate import SamplingParams, left_padded
from .memory import release_freed_memory

PREFILL_TOKENS = 2048  # new prompts prefill together while (group size) x (longest) stays within this


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
class Engine:
    lm: object  # pipeline.TextModel
    max_batch: int = 8
    ctx: int = 4096
    max_queue: int = 64
    rows: list = field(default_factory=list)

    def __post_init__(self):
        model = self.lm.model
        self.ctx = min(self.ctx, model.config.context_length)
        self.cache = RowCache(model, self.max_batch, self.ctx)
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
                    for job, _ in self.rows:
                        job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
                    self.rows.clear()
                    self.cache.clear()
        for job, _ in self.rows:
            job.emit(Failed("the server is shutting down", 503))

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
                job.emit(Failed(str(e), 400))
                continue
            except Exception as e:  # this request's own failure (its template, its text): never another's
                job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
                continue
            job.emit(Start(len(ids)))
            ready.append((job, ids, job.max_tokens or room))
        for group in prefill_groups(ready):
            rows = len(self.rows)
            try:
                self._prefill(group)
            except Exception as e:  # the group's own forward failed before it joined: only its jobs fail
                del self.rows[rows:]
                self.cache.drop_after(rows)
                for job, _, _ in group:
                    job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))

    def _prefill(self, group: list[tuple[Job, list[int], int]]) -> None:
        """Prefill new sequences as one left-padded batch; they join the shared cache's rows."""
        model = self.lm.model
        seqs = [(job, Sequence(ids, replace(job.params, max_new_tokens=max_tokens), self.lm.eos_ids, self.lm.tokenizer,
                               model.device, model.config.vocab_size, job.presence_penalty, job.frequency_penalty))
                for job, ids, max_tokens in group]
        n, L = len(group), max(len(ids) for _, ids, _ in group)
        ids, mask, positions = left_padded([ids for _, ids, _ in group], L, device=model.device)
        alone = model.new_cache(n, L)
        logits = model(ids, alone, positions, None if bool(mask.all()) else mask, last_only=True)
        self.cache.join(alone, mask)
        self.rows.extend(seqs)
        self._pick(seqs, logits[:, -1])

    def _step(self) -> None:
        view, mask = self.cache.next_step()
        dev = self.lm.model.device
        ids = torch.tensor([[seq.token] for _, seq in self.rows], device=dev)
        positions = torch.tensor([[seq.position] for _, seq in self.rows], device=dev)
        logits = self.lm.model(ids, view, positions, mask, last_only=True)
        self.cache.stepped()
        self._pick(self.rows, logits[:, -1])

    def _pick(self, rows: list[tuple[Job, Sequence]], logits: torch.Tensor) -> None:
        """Each row's next token from its logits (B, V) and its events; finished, failed and abandoned
        rows leave. A failure in one row's sampling is that row's alone."""
        argmax, finite = self.lm.model.ops.argmax_rows(logits)
        for i, (job, seq) in enumerate(rows):
            if job.cancelled:
                seq.finished = True
                continue
            try:
                events = seq.step(logits[i], finite[i], argmax[i])
            except Exception as e:
                events = seq.fail(f"internal error: {type(e).__name__}: {e}")
            for event in events:
                job.emit(event)
        i = 0
        while i < len(self.rows):
            job, seq = self.rows[i]
            if seq.finished or job.cancelled:
                self.cache.leave(i)
                self.rows[i] = self.rows[-1]
                self.rows.pop()
            else:
                i += 1
