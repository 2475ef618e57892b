"""The server's prompt cache: what it keeps and drops (unit), and in the engine a chat's next turn that
reuses the previous turn's keys and values, prefilling only the rest, with the answer of an uncached run."""
import threading
import time

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
