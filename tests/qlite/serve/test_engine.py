"""The continuous-batching engine in bf16 on native widths (so the native batched attention and
argmax run where the CPU has them): prompts prefilled together and sequences joining mid-run give
each prompt's answer alone."""
import threading
import time

import pytest
import torch

from qlite import native
from qlite.decode import Done, Failed, Text
from qlite.fused import FusedLayers
from qlite.generate import left_padded
from qlite.pipeline import load
from qlite.serve.engine import GROUP_CACHE_TOKENS, PREFILL_TOKENS, Engine, Job, Ready, prefill_groups
from qlite.speculate import Drafter
from tests.tiny_models import NATIVE_WIDTHS, make_checkpoint

PROMPTS = ["the", "he in the a", "a", "the the he", "in the he in the he in the", "he", "t", "a the in",
           "in in", "the a the a the", "he he"]


def test_prefill_groups_stay_within_the_token_bounds():
    def item(n, cached=0):
        return Ready(None, [0] * n, 1, cached)
    lengths = [10, 30, 20, PREFILL_TOKENS // 2, PREFILL_TOKENS // 2, PREFILL_TOKENS + 5, 7]
    groups = prefill_groups([item(n) for n in lengths])
    assert [[len(r.ids) for r in g] for g in groups] == [
        [10, 30, 20], [PREFILL_TOKENS // 2, PREFILL_TOKENS // 2], [PREFILL_TOKENS + 5], [7]]
    assert all(len(g) == 1 or len(g) * max(len(r.ids) for r in g) <= PREFILL_TOKENS for g in groups)
    assert prefill_groups([]) == []
    # prompts the prompt cache mostly holds: bounded by what they prefill, and by their own cache
    long = GROUP_CACHE_TOKENS // 4
    groups = prefill_groups([item(long, long - 1) for _ in range(6)] + [item(long, long - 700)])  # 3 x 700 > 2048
    assert [len(g) for g in groups] == [4, 2, 1]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from quantize.convert import convert
    src = make_checkpoint(tmp_path_factory.mktemp("engine") / "bf16", **NATIVE_WIDTHS)
    int4 = convert(src, src.parent / "int4", bits=4, group_size=128, progress=False).out_dir
    return load(int4, dtype="bfloat16")


def submit(engine, lm, prompt, max_tokens, answers):
    done = threading.Event()
    pieces = []

    def emit(event):
        if isinstance(event, Text):
            pieces.append(event.text)
        elif isinstance(event, (Done, Failed)):
            answers[prompt] = "".join(pieces) if isinstance(event, Done) else event
            done.set()

    engine.submit(Job(prepare=lambda: lm.prompt_ids(prompt, chat=False), params=lm.params(), emit=emit,
                      max_tokens=max_tokens))
    return done


@pytest.mark.parametrize("kv_bits", [16, 8])
def test_prompts_prefilled_together_and_joining_later_are_exact(lm, monkeypatch, kv_bits):
    """8 prompts of different lengths queued before the engine starts prefill as one padded batch;
    three more join while those decode (the cache shifts right for the longest). Each answer equals
    the prompt alone through `qlite generate`'s path, with a bf16 or an int8 KV cache."""
    monkeypatch.setattr(lm.model, "kv_bits", kv_bits)
    want = {p: lm.generate(p, chat=False, max_new_tokens=12) for p in PROMPTS}
    calls = []
    if native.library() is not None:  # decode steps run in one native call (fused.py)
        real = FusedLayers.__call__
        monkeypatch.setattr(FusedLayers, "__call__",
                            lambda self, x, step: calls.append((x.shape[0], step.key_starts)) or real(self, x, step))
    engine = Engine(lm, max_batch=8, ctx=96)
    answers = {}
    first = [submit(engine, lm, p, 12, answers) for p in PROMPTS[:8]]
    engine.start()
    try:
        first[0].wait(60)  # the first finishes, rows free up: the rest join a running batch
        later = [submit(engine, lm, p, 12, answers) for p in PROMPTS[8:]]
        for event in first + later:
            assert event.wait(120)
    finally:
        engine.stop()
    assert answers == want
    if native.library() is not None:  # the padded batches took the native step, with each row's start
        assert any(B > 1 and starts is not None for B, starts in calls)


@pytest.mark.parametrize("kv_bits", [16, 8])
def test_a_left_padded_prefill_gives_each_row_its_prompt_alone_bitwise(lm, monkeypatch, kv_bits):
    """Each row's attention over its own keys (TorchOps.rows_alone): one padded call's sums over the padding's
    keys too, zero weights but another order, and these prompts' bits differed from alone (0.07 in a logit
    with the int8 cache, enough to change a greedy token of the test above)."""
    monkeypatch.setattr(lm.model, "kv_bits", kv_bits)
    prompts = [lm.prompt_ids(p, chat=False) for p in ("the the he", "in the he in the he in the", "a")]
    L = max(len(p) for p in prompts)
    ids, mask, positions = left_padded(prompts, L)
    with torch.inference_mode():
        batch = lm.model(ids, lm.model.new_cache(len(prompts), L), positions, mask, last_only=True)[:, -1]
        for row, p in enumerate(prompts):
            alone = lm.model(torch.tensor([p]), lm.model.new_cache(1, len(p)), last_only=True)[0, -1]
            assert torch.equal(batch[row], alone), row


def test_bf16_logits_argmax_natively_where_it_can(lm):
    logits = torch.randn(3, lm.model.config.vocab_size).bfloat16()
    top, finite = lm.model.ops.argmax_rows(logits)
    assert top == logits.float().argmax(-1).tolist() and finite == [True] * 3


def test_a_prefill_that_fails_fails_its_own_requests_alone(lm, monkeypatch):
    """A request whose prefill raises (here: a forward that fails on its tokens) gets its error; the
    sequence already decoding goes on and answers as it does alone."""
    want = lm.generate("the the he", chat=False, max_new_tokens=160)  # long enough to be decoding when the bad one comes
    forward = type(lm.model).forward
    bad = lm.prompt_ids("he he", chat=False)

    def failing(self, ids, *args, **kwargs):
        if ids.shape[1] == len(bad) and ids[0].tolist() == bad:
            raise RuntimeError("a kernel failed on this prompt")
        return forward(self, ids, *args, **kwargs)

    engine = Engine(lm, max_batch=4, ctx=256).start()
    try:
        answers = {}
        first = submit(engine, lm, "the the he", 160, answers)
        deadline = time.monotonic() + 60
        while engine.load()["active"] == 0:  # decoding before the bad one arrives
            assert not first.wait(0.005), "the first request ended before it was seen decoding"
            assert time.monotonic() < deadline, "the first request never started decoding"
        monkeypatch.setattr(type(lm.model), "forward", failing)
        submit(engine, lm, "he he", 8, answers).wait(60)
        assert first.wait(60)
    finally:
        engine.stop()
    failed = answers["he he"]
    assert isinstance(failed, Failed) and failed.status == 500 and "RuntimeError" in failed.message
    assert answers["the the he"] == want


@pytest.mark.skipif(native.library() is None, reason="speculation needs the native kernels")
def test_speculation_alone_and_plain_steps_in_a_batch_answer_as_plain_decoding(lm, monkeypatch):
    """With a speculation, a sequence alone in the batch decodes by verified proposals; sequences
    decoding together take plain batched steps, and the last one left speculates again. Every answer
    is the prompt's alone; a job that opts out has no speculator; each that speculated gives the drafter
    its answer when it ends (the drafter's memory of earlier answers). The drafter knows each answer but
    proposes a wrong token every third pass, so both paths of a pass run. (Passes cost what the pacer's
    model says: on a tiny model it would rightly find proposals not worth their rows.)"""
    from dataclasses import replace

    from qlite.decode import Sequence, decode_batch
    from qlite.speculate import Pacer, Speculation
    monkeypatch.setattr(Pacer, "cost", lambda self, rows: 1 + Pacer.ROW_COST * (rows - 1))
    prompts = {"in the he in the he in the": 40, "the the he": 8, "he he": 16, "a the in a the in": 40}
    want = {p: lm.generate(p, chat=False, max_new_tokens=n) for p, n in prompts.items()}
    answers_ids = []
    for p, n in prompts.items():
        ids = lm.prompt_ids(p, chat=False)
        seq = Sequence(ids, replace(lm.params(), max_new_tokens=n), lm.eos_ids)
        answers_ids.append(ids + [t for [(t, _)] in decode_batch(lm.model, [ids], [seq])])

    class Oracle(Drafter):
        calls, remembered = 0, []

        def remember(self, answer):
            self.remembered.append(answer)

        def propose(self, tokens, k):
            self.calls += 1
            full = next((a for a in answers_ids if a[:len(tokens)] == tokens), tokens)
            return [*full[len(tokens):len(tokens) + k - 1], 0 if self.calls % 3 == 0 else full[len(tokens) + k - 1]] \
                if len(full) >= len(tokens) + k else full[len(tokens):]

    engine = Engine(lm, max_batch=4, ctx=128, speculation=Speculation(Oracle())).start()
    answers, jobs = {}, {}
    try:
        for group in (list(prompts)[:1], list(prompts)[1:]):  # one alone, then three together
            done = []
            for p in group:
                done.append(threading.Event())
                pieces = []

                def emit(event, pieces=pieces, p=p, done=done[-1]):
                    if isinstance(event, Text):
                        pieces.append(event.text)
                    elif isinstance(event, (Done, Failed)):
                        answers[p] = "".join(pieces) if isinstance(event, Done) else event
                        done.set()
                jobs[p] = Job(prepare=lambda p=p: lm.prompt_ids(p, chat=False), params=lm.params(), emit=emit,
                              max_tokens=prompts[p], speculate=p != "he he")
            for p in group:
                engine.submit(jobs[p])
            assert all(d.wait(120) for d in done)
    finally:
        engine.stop()
    assert answers == want
    assert jobs["he he"].speculator is None
    alone, last = jobs["in the he in the he in the"].speculator.stats, jobs["a the in a the in"].speculator.stats
    assert 0 < alone.accepted < alone.proposed and alone.passes < alone.tokens / 2
    assert alone.tokens == len(answers_ids[0]) - len(lm.prompt_ids(list(prompts)[0], chat=False))
    assert last.proposed > 0 and last.passes < last.tokens  # once alone
    generated = [a[len(lm.prompt_ids(p, chat=False)):] for p, a in zip(prompts, answers_ids) if p != "he he"]
    assert sorted(Oracle.remembered) == sorted(generated)  # each speculating job's answer, once it ended


@pytest.mark.parametrize("kv_bits", [16, 8])
def test_a_prompt_that_starts_as_a_finished_one_reuses_its_keys_and_values(lm, monkeypatch, kv_bits):
    """bf16 on the native kernels, with a bf16 and an int8 KV cache (records copied as they are): a
    longer prompt that starts with a finished request's tokens is prefilled from them, and answers as
    the same prompt prefilled whole."""
    monkeypatch.setattr(lm.model, "kv_bits", kv_bits)
    base = "in the he in the he in the he in the a the he in"
    engine = Engine(lm, max_batch=4, ctx=160).start()
    try:
        answers = {}
        assert submit(engine, lm, base, 8, answers).wait(60)
        longer = base + answers[base] + " the a"
        assert submit(engine, lm, longer, 8, answers).wait(60)
        assert engine.load()["prompt_cache"]["reused_tokens"] >= len(lm.prompt_ids(base, chat=False))
    finally:
        engine.stop()
    assert answers[longer] == lm.generate(longer, chat=False, max_new_tokens=8)


def test_the_kv_cache_grows_as_rows_lengthen(lm, monkeypatch):
    """The rows' cache starts small and doubles as the longest row needs (not max-batch x ctx up
    front); prompts joining, shifting and decoding across a growth answer as alone."""
    from qlite.decode import RowCache
    monkeypatch.setattr(RowCache, "INITIAL", 8)
    engine = Engine(lm, max_batch=4, ctx=160)
    assert engine.cache.cache.capacity == 8
    prompts = ["the he", PROMPTS[4] * 2, "a the in a the in a"]
    want = {p: lm.generate(p, chat=False, max_new_tokens=20) for p in prompts}
    answers = {}
    engine.start()
    try:
        assert submit(engine, lm, prompts[0], 20, answers).wait(60)
        later = [submit(engine, lm, p, 20, answers) for p in prompts[1:]]
        assert all(e.wait(60) for e in later)
    finally:
        engine.stop()
    assert answers == want
    longest = max(len(lm.prompt_ids(p, chat=False)) for p in prompts) + 20
    assert longest <= engine.cache.cache.capacity < 4 * longest


@pytest.mark.parametrize("padded", [False, True])
def test_a_long_prompt_joining_running_streams_is_prefilled_a_chunk_between_their_steps(lm, padded):
    """While a stream decodes, a long prompt (alone, or with a short one: a left-padded group) is
    prefilled prefill_chunk tokens at a time with the stream's steps between the chunks: the stream
    takes a step after every chunk but the last, only the last goes through the head, and every answer
    is its answer alone."""
    running, long_prompt, short = "the the he", " ".join(["in the he a"] * 24), "a the"
    joiners = [long_prompt, short] if padded else [long_prompt]
    want = {p: lm.generate(p, chat=False, max_new_tokens=n)
            for p, n in [(running, 60), *((p, 6) for p in joiners)]}
    long_len = len(lm.prompt_ids(long_prompt, chat=False))
    answers, done = {}, {}

    def job(prompt, max_tokens):
        done[prompt], pieces = threading.Event(), []

        def emit(event):
            if isinstance(event, Text):
                pieces.append(event.text)
            elif isinstance(event, (Done, Failed)):
                answers[prompt] = "".join(pieces) if isinstance(event, Done) else event
                done[prompt].set()
        return Job(prepare=lambda: lm.prompt_ids(prompt, chat=False), params=lm.params(), emit=emit,
                   max_tokens=max_tokens)

    engine = Engine(lm, max_batch=4, ctx=256, prefill_chunk=16, prompt_cache_bytes=0)
    forward, calls, heads = type(lm.model).forward, [], []

    def counting(self, ids, *args, **kwargs):
        calls.append(tuple(ids.shape))  # (rows, tokens)
        heads.append(kwargs.get("head", True))
        return forward(self, ids, *args, **kwargs)

    engine.submit(job(running, 60))
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while engine.load()["active"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(lm.model), "forward", counting)
            for p in joiners:
                engine.submit(job(p, 6))
            assert all(done[p].wait(120) for p in [running, *joiners])
    finally:
        engine.stop()
    assert answers == want
    rows, width = len(joiners), 16 // len(joiners)
    chunks = [i for i, (_, T) in enumerate(calls) if T > 1]
    assert len(chunks) == -(-long_len // width) and all(calls[i] == (rows, width) for i in chunks[:-1])
    assert all(calls[i + 1] == (1, 1) for i in chunks[:-1])  # the running row's step between two chunks
    assert [heads[i] for i in chunks] == [False] * (len(chunks) - 1) + [True]  # logits of the last chunk alone


def test_freed_memory_goes_back_once_the_engine_has_been_idle_a_while(lm, monkeypatch):
    """The idle engine hands freed memory back (a full GC, ~0.2 s holding the GIL on the demo model) only
    after IDLE_RELEASE_S without work, once per idle spell: not as a request's last events go out, nor
    between a request and one that follows at once."""
    from qlite.serve import engine as engine_module
    released = []
    monkeypatch.setattr(engine_module, "release_freed_memory", lambda: released.append(time.monotonic()))
    monkeypatch.setattr(engine_module, "IDLE_RELEASE_S", 0.3)
    def until(n):
        deadline = time.monotonic() + 30
        while len(released) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(released)

    engine = Engine(lm, max_batch=2, ctx=64).start()
    try:
        assert until(1) == 1  # what loading freed, once the engine has sat idle
        answers = {}
        assert submit(engine, lm, "the he", 4, answers).wait(60)
        done = time.monotonic()
        assert submit(engine, lm, "he in", 4, answers).wait(60)  # at once: no release between the two
        assert len(released) == 1
        assert until(2) == 2 and released[1] - done >= 0.3
        time.sleep(0.5)
        assert len(released) == 2  # once per idle spell
    finally:
        engine.stop()
