"""The server's prompt cache: what it keeps and drops (unit), and in the engine a chat's next turn that
reuses the previous turn's keys and values, prefilling only the rest, with the answer of an uncached run."""
import threading

import pytest
import torch

from qlite.decode import Done, Failed, Start, Text
from qlite.engine import Engine, Job
from qlite.pipeline import load
from qlite.prompt_cache import MIN_REUSE, PromptCache


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


@pytest.fixture(scope="module")
def lm(tiny_ckpt):
    return load(tiny_ckpt, dtype="float32")


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
