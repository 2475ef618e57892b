"""The server's prompt cache: what it keeps and drops (unit), and in the engine a chat's next turn that
reuses the previous turn's keys and values, prefilling only the rest, with the answer of an uncached run."""
import threading
import time

import pytest
import torch

from qlite import native
from qlite.backends import exact_prefill
from qlite.decode import Done, Failed, Start, Text, Token
from qlite.kv_quant import KINDS
from qlite.pipeline import load
from qlite.serve.engine import Engine, Job
from qlite.serve.prompt_cache import MIN_REUSE, PromptCache
from tests.tiny_models import NATIVE_WIDTHS, make_checkpoint


def kv(n, fill=0.0):
    return torch.full((2, 1, n, 4), fill), torch.full((2, 1, n, 4), fill)


def test_longest_start_wins_longer_entries_supersede_and_the_budget_evicts_the_oldest():
    per_token = 2 * kv(1)[0].nbytes
    cache = PromptCache(budget_bytes=100 * per_token)
    a = list(range(40))
    cache.put(a[:20], *kv(20, 1.0))
    cache.put(a, *kv(40, 2.0))  # extends the first: it goes
    assert [len(e.tokens) for e in cache.entries] == [40]
    n, entry = cache.match(a[:30] + [999])
    assert n == 30 and bool((entry.k == 2.0).all())
    assert cache.match(a[:40]) [0] == 39  # the last token is prefilled: its logits are needed
    assert cache.match([5] + a) == (0, None) and cache.match(a[:MIN_REUSE - 1] + [7]) == (0, None)
    cache.put([1000 + i for i in range(50)], *kv(50))
    cache.put([2000 + i for i in range(30)], *kv(30))  # 120 tokens in all: the least recently used goes
    assert sorted(len(e.tokens) for e in cache.entries) == [30, 50] and cache.bytes == 80 * per_token
    cache.put(list(range(5)), *kv(5))  # shorter than worth keeping
    assert len(cache.entries) == 2


needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here: no prompt cache")


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    """An int4 model (int8 head) on native widths: in bf16 every number of its prefills is the same at any
    row count and cut (backends.exact_prefill), which the prompt cache needs."""
    from quantize.convert import convert
    src = make_checkpoint(tmp_path_factory.mktemp("pcache") / "bf16", **NATIVE_WIDTHS)
    return convert(src, src.parent / "int4", bits=4, group_size=128, progress=False).out_dir


@pytest.fixture(scope="module")
def lm(int4_dir):
    return load(int4_dir, dtype="bfloat16")


def ask(engine, lm, messages, max_tokens=12):
    done, out = threading.Event(), {"text": []}

    def emit(event):
        if isinstance(event, Start):
            out["cached"] = event.cached_tokens
        elif isinstance(event, Text):
            out["text"].append(event.text)
        elif isinstance(event, (Done, Failed)):
            out["end"] = event
            done.set()
    engine.submit(Job(prepare=lambda: lm.prompt_ids(messages), params=lm.params(), emit=emit, max_tokens=max_tokens))
    assert done.wait(60)
    assert isinstance(out["end"], Done), out["end"]
    return "".join(out["text"]), out["cached"]


@needs_native
def test_a_chats_next_turn_starts_from_the_previous_turns_keys_and_values(lm):
    first = [{"role": "system", "content": "You answer in the he the in a."}, {"role": "user", "content": "the he in"}]
    engine = Engine(lm, max_batch=4, ctx=256).start()
    try:
        answer, cached = ask(engine, lm, first)
        assert cached == 0 and answer == lm.generate(first, max_new_tokens=12)
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "in the a"}]
        again, cached = ask(engine, lm, second)
        prompt = lm.prompt_ids(second)
        shared = next(i for i, (a, b) in enumerate(zip(prompt, lm.prompt_ids(first) + [0] * len(prompt))) if a != b)
        assert cached >= min(shared, len(prompt) - 1) >= MIN_REUSE  # at least the first turn's prompt
        assert again == lm.generate(second, max_new_tokens=12)
        assert engine.load()["prompt_cache"]["hits"] == 1
    finally:
        engine.stop()
    off = Engine(lm, max_batch=4, ctx=256, prompt_cache_bytes=0).start()
    try:
        assert ask(off, lm, first)[1] == 0 and ask(off, lm, first)[1] == 0 and "prompt_cache" not in off.load()
    finally:
        off.stop()


@needs_native
def test_prompts_it_holds_prefill_together_and_one_held_but_its_last_token_joins_as_a_row(lm, monkeypatch):
    """Three prompts that start with a finished request's tokens, arriving together, prefill as one group
    from their cached columns: one forward over the most tokens any of them has left. That request's
    prompt sent again while they decode, held but for its last token, takes no forward of its own: the
    next step feeds that token with the rows'. Each answers as its prompt prefilled whole."""
    base = "the he in the a the he in the he in the a in the"
    longer = [base + " in", base + " the a he", base + " a a in the he"]
    want = {p: lm.generate(p, chat=False, max_new_tokens=n) for p, n in [(base, 4), *((p, 30) for p in longer)]}
    fills, forward = [], type(lm.model).forward

    def counting(self, ids, *args, **kwargs):
        if "head" in kwargs:  # the engine's prefill forwards (its steps pass no head)
            fills.append(tuple(ids.shape))
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(lm.model), "forward", counting)
    engine = Engine(lm, max_batch=4, ctx=256).start()
    answers, cached, done = {}, {}, {}

    def submit(prompt, max_tokens):
        done[prompt], pieces = threading.Event(), []

        def emit(event):
            if isinstance(event, Start):
                cached[prompt] = event.cached_tokens
            elif isinstance(event, Text):
                pieces.append(event.text)
            elif isinstance(event, (Done, Failed)):
                answers[prompt] = "".join(pieces) if isinstance(event, Done) else event
                done[prompt].set()
        engine.submit(Job(prepare=lambda: lm.prompt_ids(prompt, chat=False), params=lm.params(), emit=emit,
                          max_tokens=max_tokens))

    try:
        submit(base, 4)
        assert done[base].wait(60)
        fills.clear()
        with engine.wake:  # the engine thread waits: all three are queued when it next looks
            for p in longer:
                submit(p, 30)
        while engine.load()["active"] < 3:
            time.sleep(0.001)
        answers.pop(base)
        submit(base, 4)
        assert all(done[p].wait(60) for p in [base, *longer])
        hits = engine.load()["prompt_cache"]
    finally:
        engine.stop()
    assert answers == want
    lengths = [len(lm.prompt_ids(p, chat=False)) for p in longer]
    rests = {n - cached[p] for n, p in zip(lengths, longer)}  # each row from the group's first column to prefill
    assert len(set(lengths)) == 3 and len(rests) == 1 and all(cached[p] >= MIN_REUSE for p in longer)
    assert fills == [(3, *rests)]  # one forward for the group; none for base again
    assert cached[base] == len(lm.prompt_ids(base, chat=False)) - 1
    assert hits["hits"] == 4 and hits["reused_tokens"] == sum(cached.values())


# --- one rule for every key and value: a prompt's numbers do not depend on what the cache held (issue 54) ---

@needs_native
@pytest.mark.usefixtures("native_isa")
@pytest.mark.parametrize("kv", sorted(KINDS))
def test_a_prompt_gives_the_same_bits_however_it_was_cut(int4_dir, kv):
    """The logits after a prompt prefilled whole equal, bit for bit, those after its prefix prefilled first
    (as a cached prefix is) and the rest after it in one forward or token by token: every key and value is
    read back from the cache's records by the decode step's arithmetic, and every product is row-exact. With
    the int4 cache, 4 of 26 greedy answers changed when their prefix came from the prompt cache."""
    from qlite.loader import load_model
    model = load_model(int4_dir, dtype="bfloat16", kv_cache=kv)
    assert exact_prefill(model)
    ids = torch.randint(0, 260, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = model(ids, model.new_cache(1, 160), last_only=True)[0, -1]
        for cuts in ((20,), (64, 100), (17, 140, 149), tuple(range(140, 150))):
            cache, start = model.new_cache(1, 16, limit=160), 0  # grows as it goes, as a server row's does
            for end in (*cuts, 150):
                out = model(ids[:, start:end], cache, last_only=True)[0, -1]
                start = end
            assert torch.equal(out, whole), cuts


def greedy_tokens(engine, lm, prompts, max_tokens=20):
    """Each prompt's greedy token ids and cached tokens, all submitted at once."""
    done, out = [], [None] * len(prompts)
    for i, prompt in enumerate(prompts):
        event, tokens, info = threading.Event(), [], {}

        def emit(e, tokens=tokens, event=event, info=info, i=i):
            if isinstance(e, Start):
                info["cached"] = e.cached_tokens
            elif isinstance(e, Token):
                tokens.append(e.token)
            elif isinstance(e, (Done, Failed)):
                out[i] = (tokens if isinstance(e, Done) else e, info.get("cached"))
                event.set()
        engine.submit(Job(prepare=lambda p=prompt: list(p), params=lm.params(temperature=0), emit=emit,
                          max_tokens=max_tokens))
        done.append(event)
    assert all(e.wait(120) for e in done)
    return out


@needs_native
@pytest.mark.parametrize("kv", sorted(KINDS))
def test_the_same_greedy_request_cold_warm_and_in_a_batch_of_8_answers_the_same(lm, monkeypatch, kv):
    """A long shared prefix and short suffixes: each request alone on a server without a prompt cache,
    then cold, warm (its prefix from the cache) and all 8 at once sharing their prefix: the same tokens."""
    monkeypatch.setattr(lm.model, "kv_bits", KINDS[kv])
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 260, (120,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 260, (n,), generator=gen).tolist() for n in (3, 5, 1, 7, 2, 9, 4, 6)]
    off = Engine(lm, max_batch=8, ctx=256, prompt_cache_bytes=0).start()
    try:
        want = [greedy_tokens(off, lm, [p])[0][0] for p in prompts]
    finally:
        off.stop()
    on = Engine(lm, max_batch=8, ctx=256).start()
    try:
        cold = greedy_tokens(on, lm, prompts[:1])
        warm = [greedy_tokens(on, lm, [p])[0] for p in prompts]
        batch = greedy_tokens(on, lm, prompts)
    finally:
        on.stop()
    assert cold == [(want[0], 0)]
    assert [t for t, _ in warm] == want and all(cached >= len(prefix) for _, cached in warm)
    assert [t for t, _ in batch] == want and all(cached >= len(prefix) for _, cached in batch)


def test_where_a_prefill_is_not_row_exact_the_prompt_cache_is_off_and_says_why(tiny_ckpt, int4_dir, tmp_path):
    """float32 on torch's matmuls, or dynamic NTK (its angles follow the forward's length past the context): a
    cached prefix would change answers' bits, so there is none."""
    import json
    import shutil
    dynamic = shutil.copytree(int4_dir, tmp_path / "dynamic")
    config = json.loads((dynamic / "config.json").read_text())
    (dynamic / "config.json").write_text(json.dumps(dict(config, rope_scaling={"type": "dynamic", "factor": 2.0})))
    for lm in (load(tiny_ckpt, dtype="float32"), load(dynamic, dtype="bfloat16")):
        engine = Engine(lm, max_batch=2, ctx=64)
        assert engine.prompt_cache is None and "not row-exact" in engine.prompt_cache_off
        assert "prompt_cache" not in engine.load()
