"""Continuous batching, scheduling only: one thread owns the model; every decode step runs all active
sequences at once (one forward), new sequences are prefilled together (a left-padded batch of those
waiting, bounded by PREFILL_TOKENS) and join between steps, finished or abandoned ones leave. While other
sequences are decoding, a prefill goes a chunk at a time (`prefill_chunk` prompt tokens between two of
their steps), so a long prompt that arrives delays the streams already running by a chunk, not by itself.
Each sequence's token, text and end are decode.Sequence's (the step `qlite generate` takes too), and
its KV rows decode.RowCache's: --max-batch rows of at most --ctx tokens, grown as the rows lengthen, so a
full server queues (and past --max-queue refuses) but never holds more. One active row alone is kept at
start 0, so it takes the same path as `qlite generate` (no mask). A finished sequence's keys and values
go into the prompt cache (prompt_cache.py); prompts that start with an entry's tokens are prefilled
together from them, and those it holds but for their last token join the rows at once (the next step
feeds that token).

Speculation (`speculation`, a speculate.Speculation: qlite serve --speculate): a job that asks for it
(`speculate`) gets its own Speculator (its drafter's state and its stats; the pacer, which learns what
passes cost and how often proposals are taken, is the engine's, so a request does not start from a
guess). While its row is the only active one it decodes by proposals verified in one exact forward, as `qlite generate --speculate` does (the
same tokens as plain steps); alongside other rows it takes plain batched steps. A batch already feeds
its rows to one pass over the weights, which is what speculation buys a lone sequence; verifying
uneven proposals per row would need a cache whose rows end at different places (see docs).
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..backends import exact_prefill
from ..decode import Event, Failed, RowCache, Sequence, Shaping, Start
from ..errors import QliteError
from ..generate import SamplingParams, left_padded
from ..memory import release_freed_memory
from .prompt_cache import PromptCache

IDLE_RELEASE_S = 0.5  # idle this long, the engine hands freed memory back (release_freed_memory): not at once,
# where its GC held the GIL ~0.2 s just as the answer's last chunk was to go out (the demo model, Zen 3)
PREFILL_TOKENS = 2048  # new prompts prefill together while (group size) x (most tokens to prefill) stays within this
GROUP_CACHE_TOKENS = 4 * PREFILL_TOKENS  # and (group size) x (longest prompt): the group's own cache until it joins


@dataclass
class Ready:
    """An admitted request: its prompt ids, its token budget, and the longest start of them the prompt cache
    holds (cached tokens, in `entry`)."""
    job: "Job"
    ids: list[int]
    max_tokens: int
    cached: int = 0
    entry: object = None  # prompt_cache.Entry

    @property
    def rest(self) -> int:  # tokens left to prefill
        return len(self.ids) - self.cached


def prefill_groups(ready: list[Ready]) -> list[list[Ready]]:
    """Split requests in arrival order into groups that prefill as one padded batch: a group grows while its
    size times the most tokens one of them has left to prefill stays within PREFILL_TOKENS (so padding and
    activations stay bounded) and its size times its longest prompt within GROUP_CACHE_TOKENS; a longer
    prompt goes alone."""
    groups: list[list[Ready]] = []
    most = longest = 0
    for item in ready:
        n = len(groups[-1]) + 1 if groups else 0
        if groups and n * max(most, item.rest) <= PREFILL_TOKENS and n * max(longest, len(item.ids)) <= GROUP_CACHE_TOKENS:
            groups[-1].append(item)
            most, longest = max(most, item.rest), max(longest, len(item.ids))
        else:
            groups.append([item])
            most, longest = item.rest, len(item.ids)
    return groups


@dataclass
class Job:
    """One request: `prepare` (run on the engine thread: templates render there) gives the prompt
    ids; events go to `emit` (thread-safe); set `cancelled` to abandon it (a client that left)."""
    prepare: Callable[[], list[int]]
    params: SamplingParams  # max_new_tokens: the request's max_tokens, or None-like 0 for "to the context"
    emit: Callable[[Event], None]
    max_tokens: int | None = None
    shaping: Shaping = field(default_factory=Shaping)  # penalties, logit_bias, a constraint, logprobs
    speculate: bool = True  # where the engine has a speculation: this job uses it
    cancelled: bool = False
    speculator: object = None  # the engine's, once prefilled with speculation (its .stats: the usage extras)


@dataclass
class Filling:
    """New sequences being prefilled into their own cache, a chunk of prompt columns at a time; they join
    the rows when the last chunk is in."""
    seqs: list  # (job, Sequence)
    cache: object  # their KVCache, n rows of the longest prompt
    ids: torch.Tensor  # (n, L) left-padded
    mask: torch.Tensor  # (n, L) True at real tokens
    positions: torch.Tensor  # (n, L)
    done: int  # columns already in the cache (a prompt-cache hit's prefix included)

    @property
    def key_mask(self) -> torch.Tensor | None:  # the forward's: None when no row is padded
        return None if bool(self.mask.all()) else self.mask


@dataclass
class Engine:
    lm: object  # pipeline.TextModel
    max_batch: int = 8
    ctx: int = 4096
    max_queue: int = 64
    speculation: object = None  # speculate.Speculation, or None
    prompt_cache_bytes: int = 256 << 20  # finished sequences' keys and values kept for later prompts (0: none)
    prefill_chunk: int = 256  # prompt tokens prefilled between two steps of running rows (0: whole prompts)
    rows: list = field(default_factory=list)

    def __post_init__(self):
        model = self.lm.model
        self.ctx = min(self.ctx, model.config.context_length)
        self.cache = RowCache(model, self.max_batch, self.ctx)
        self.waiting: collections.deque[Job] = collections.deque()
        self.filling: collections.deque[Filling] = collections.deque()
        self.wake = threading.Condition()
        self.stopping = False
        self.pacer = None  # speculation's, shared by the requests
        # a prefix from the cache must give the bits a fresh prefill would: only where every number of a
        # prefill is the same at any row count and cut (backends.exact_prefill); elsewhere it stays off, said why
        self.prompt_cache_off = None
        if self.prompt_cache_bytes and not exact_prefill(model):
            self.prompt_cache_bytes, self.prompt_cache_off = 0, (
                "this run's prefill is not row-exact (a float32 or non-native run, decoder layers that a prefill "
                "multiplies by a matmul: 16-bit ones, or dynamic NTK rope), so a cached prefix would change answers")
        self.prompt_cache = PromptCache(self.prompt_cache_bytes) if self.prompt_cache_bytes else None
        self.thread = threading.Thread(target=self._run, name="qlite-engine", daemon=True)

    # --- the outside ---
    def start(self) -> "Engine":
        self.thread.start()
        return self

    @classmethod
    def on_own_thread(cls, build: Callable[[], "Engine"]) -> "Engine":
        """The engine `build` makes (loading the model) on a new thread, which then runs the engine there:
        every OpenMP parallel region of the model then starts from that one thread. A second thread that
        starts them gets a second team; libgomp, with more of its threads than CPUs, then stops spinning
        between regions, and each of a step's ~120 regions (the demo model) waits on a wake-up, which
        made a decode step markedly slower in a thread beside the loading one."""
        box, ready = {}, threading.Event()

        def own():
            try:
                box["engine"] = engine = build()
                engine.thread = threading.current_thread()
            except BaseException as e:  # the caller's to raise (a QliteError: a one-line error)
                box["error"] = e
                return
            finally:
                ready.set()
            engine._run()

        threading.Thread(target=own, name="qlite-engine", daemon=True).start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        return box["engine"]

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join()

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (the caller answers 503): more than max_queue
        jobs would wait beyond the free rows of the batch."""
        with self.wake:
            if len(self.waiting) - (self.max_batch - self._rows_taken()) >= self.max_queue:
                return False
            self.waiting.append(job)
            self.wake.notify()
            return True

    def load(self) -> dict:
        cache = self.prompt_cache
        return {"active": len(self.rows), "prefilling": self._rows_taken() - len(self.rows),
                "waiting": len(self.waiting), "max_batch": self.max_batch, "ctx": self.ctx,
                **({"prompt_cache": {"entries": len(cache.entries), "mib": round(cache.bytes / 2**20, 1), "hits": cache.hits,
                                     "reused_tokens": cache.reused_tokens}} if cache is not None else {})}

    # --- the engine thread ---
    def _idle(self) -> bool:
        return not self.stopping and not self.waiting and not self.rows and not self.filling

    def _run(self) -> None:
        with torch.inference_mode():
            released = False
            while True:
                with self.wake:
                    if self._idle() and not released:  # a moment first: a request that follows at once does not wait
                        self.wake.wait(IDLE_RELEASE_S)
                    release = self._idle() and not released
                    while not release and self._idle():
                        self.wake.wait()
                    if self.stopping:
                        break
                if release:  # idle a while: the heap that loading and requests used goes back to the OS
                    release_freed_memory()  # a full GC (~0.2 s holding the GIL on the demo model), off the lock
                    released = True
                    continue
                released = False
                try:
                    self._admit()
                    if self.filling:
                        self._fill()
                    if self.rows:
                        self._step()
                except Exception as e:  # a bug in a shared step must not hang every client: fail the active ones, go on
                    for job, _ in self._all_jobs():
                        job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
                    self.rows.clear()
                    self.filling.clear()
                    self.cache.clear()
        for job, _ in self._all_jobs():
            job.emit(Failed("the server is shutting down", 503))

    def _all_jobs(self) -> list[tuple[Job, Sequence]]:
        return self.rows + [row for f in self.filling for row in f.seqs]

    def _rows_taken(self) -> int:  # also read by submit's threads: tuple() copies the deque in one step
        return len(self.rows) + sum(len(f.seqs) for f in tuple(self.filling))

    def _next_job(self, admitted: int) -> Job | None:
        with self.wake:
            return self.waiting.popleft() if self.waiting and self._rows_taken() + admitted < self.max_batch else None

    def _admit(self) -> None:
        """Take waiting jobs while rows are free; they prefill in groups (_fill): those that start with tokens
        the prompt cache holds together, from them; the others together."""
        ready: list[Ready] = []
        while (job := self._next_job(len(ready))) is not None:
            if job.cancelled:
                continue
            try:
                ids = job.prepare()
                if not ids:
                    raise QliteError("the prompt is empty")
                room = self.ctx - len(ids)
                if room < 1 or (job.max_tokens is not None and job.max_tokens > room):
                    job.emit(Failed(f"the prompt is {len(ids)} tokens, the context is {self.ctx}" if room < 1 else
                                    f"max_tokens {job.max_tokens}: the prompt is {len(ids)} tokens and the context "
                                    f"{self.ctx}, so at most {room} can follow", 400, "context_length_exceeded"))
                    continue
            except QliteError as e:
                job.emit(Failed(str(e), 400))
                continue
            except Exception as e:  # this request's own failure (its template, its text): never another's
                job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
                continue
            cached, entry = self.prompt_cache.match(ids) if self.prompt_cache is not None else (0, None)
            ready.append(Ready(job, ids, job.max_tokens or room, cached, entry))
        hits = [item for item in ready if item.entry is not None]
        for group in prefill_groups(hits) + prefill_groups([item for item in ready if item.entry is None]):
            try:
                self.filling.append(self._filling(group))
            except Exception as e:  # only this group's jobs fail
                for item in group:
                    item.job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))

    def _filling(self, group: list[Ready]) -> Filling:
        """New sequences as one left-padded batch with its own cache: the columns that every row holds from
        the prompt cache (or as padding) copied from its entry, the rest for _fill to prefill."""
        model = self.lm.model
        seqs = [(item.job, Sequence(item.ids, replace(item.job.params, max_new_tokens=item.max_tokens), self.lm.eos_ids,
                                    self.lm.tokenizer, model.device, model.config.vocab_size, item.job.shaping))
                for item in group]
        n, L = len(group), max(len(item.ids) for item in group)
        ids, mask, positions = left_padded([item.ids for item in group], L, device=model.device)
        alone = model.new_cache(n, L)
        done = L - max(item.rest for item in group)  # each row's first `cached` tokens, or padding, lie before it
        alone.length = done
        for i, item in enumerate(group):
            first = L - len(item.ids)  # row i's first column
            taken = max(0, done - first)  # its tokens up to column done, from its entry (at most item.cached)
            if taken:
                alone.k[:, i, :, first:done], alone.v[:, i, :, first:done] = item.entry.k[:, :, :taken], \
                    item.entry.v[:, :, :taken]
                self.prompt_cache.took(taken)
            item.job.emit(Start(len(item.ids), taken))
        return Filling(seqs, alone, ids, mask, positions, done)

    def _fill(self) -> None:
        """The first filling's next chunk (all of it while no row is decoding); a full one joins the rows and
        takes its first tokens. A filling with only its last column left (prompts the prompt cache held but
        for their last token) joins as it is: the next step feeds those tokens as its rows' own, one more
        row in a pass over the weights instead of a forward of its own. A failure is its jobs' alone."""
        f, model = self.filling[0], self.lm.model
        if all(job.cancelled for job, _ in f.seqs):
            self.filling.popleft()
            return
        n, L = f.ids.shape
        end = min(L, f.done + max(1, self.prefill_chunk // n)) if self.rows and self.prefill_chunk else L
        rows = len(self.rows)
        try:
            if 0 < f.done == L - 1:
                self.filling.popleft()
                return self._join(f, None)
            logits = model(f.ids[:, f.done:end], f.cache, f.positions[:, f.done:end],
                           None if f.key_mask is None else f.key_mask[:, :end], last_only=True, head=end == L)
            f.done = end
            if end < L:
                return
            self.filling.popleft()
            self._join(f, logits)
        except Exception as e:  # its own forward or first pick failed: only its jobs fail
            if self.filling and self.filling[0] is f:
                self.filling.popleft()
            del self.rows[rows:]
            self.cache.drop_after(rows)
            for job, _ in f.seqs:
                job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))

    def _join(self, f: Filling, logits: torch.Tensor | None) -> None:
        """A filled group into the shared cache's rows, with its first tokens from the logits of its last
        column (None: not prefilled, the next step feeds it)."""
        seqs = f.seqs
        self.cache.join(f.cache, f.mask[:, :f.cache.length])
        self.rows.extend(seqs)
        if self.speculation is not None:
            from ..speculate import Pacer, Speculator
            if self.pacer is None:  # one for every request: what passes cost and how often proposals are taken
                self.pacer = Pacer(self.speculation.most, drafter=self.speculation.drafter)  # carry over
            for job, _ in seqs:
                if job.speculate:
                    job.speculator = Speculator(self.speculation.drafter, self.speculation.most, pacer=self.pacer)
        if logits is not None:
            self._pick(seqs, logits[:, -1])

    def _step(self) -> None:
        if len(self.rows) == 1 and self.rows[0][0].speculator is not None:
            return self._speculative_step(*self.rows[0])
        view, mask = self.cache.next_step()
        dev = self.lm.model.device
        ids = torch.tensor([[seq.token] for _, seq in self.rows], device=dev)
        positions = torch.tensor([[seq.position] for _, seq in self.rows], device=dev)
        logits = self.lm.model(ids, view, positions, mask, last_only=True)
        self.cache.stepped()
        self._pick(self.rows, logits[:, -1])

    def _speculative_step(self, job: Job, seq: Sequence) -> None:
        """The lone row's next pass: its proposals and token in one exact forward, the tokens it takes
        (plain decoding's), the cache kept up to them."""
        spec, model = job.speculator, self.lm.model
        t0 = time.perf_counter()
        draft = spec.propose(seq, min(self.ctx - self.cache.t - 1, seq.params.max_new_tokens - seq.generated - 1))
        view, mask = self.cache.next_step(1 + len(draft))  # alone: at start 0, no mask
        t = self.cache.t
        logits = model(torch.tensor([[seq.token, *draft]], device=model.device), view, exact=bool(draft))[0]
        spec.timed(1 + len(draft), time.perf_counter() - t0)
        try:
            steps = [] if job.cancelled else spec.verify(seq, logits, model.ops, self.ctx)
        except Exception as e:
            steps = [(None, seq.fail(str(e) if isinstance(e, QliteError) else f"internal error: {type(e).__name__}: {e}"))]
        self.cache.key_mask[0, t:t + len(steps)] = True
        self.cache.cache.length = t + len(steps)
        self._leave_finished()
        for _, events in steps:
            for event in events:
                job.emit(event)

    def _remember(self, i: int, seq: Sequence) -> None:
        """Row i's keys and values, with the tokens they are of, into the prompt cache."""
        t = self.cache.t
        held = self.cache.key_mask[i, :t]
        start = int(held.nonzero()[0]) if bool(held.any()) else t
        if len(seq.history) >= t - start:
            self.prompt_cache.put(seq.history[:t - start], self.cache.cache.k[:, i, :, start:t],
                                  self.cache.cache.v[:, i, :, start:t])

    def _pick(self, rows: list[tuple[Job, Sequence]], logits: torch.Tensor) -> None:
        """Each row's next token from its logits (B, V) and its events; finished, failed and abandoned
        rows leave, then the events go out (a request told it is done is out of the batch). A failure
        in one row's sampling is that row's alone."""
        argmax, finite = self.lm.model.ops.argmax_rows(logits)
        out = []
        for i, (job, seq) in enumerate(rows):
            if job.cancelled:
                seq.finished = True
                continue
            try:
                events = seq.step(logits[i], finite[i], argmax[i])
            except Exception as e:
                events = seq.fail(f"internal error: {type(e).__name__}: {e}")
            if job.speculator is not None:
                job.speculator.took()
            out.append((job, events))
        self._leave_finished()
        for job, events in out:
            for event in events:
                job.emit(event)

    def _leave_finished(self) -> None:
        i = 0
        while i < len(self.rows):
            job, seq = self.rows[i]
            if seq.finished or job.cancelled:
                if self.prompt_cache is not None and not seq.failed:
                    self._remember(i, seq)
                if job.speculator is not None and not seq.failed:
                    job.speculator.finish(seq)
                self.cache.leave(i)
                self.rows[i] = self.rows[-1]
                self.rows.pop()
            else:
                i += 1
