"""The server's request handling in parts, without HTTP: Choices submits a request's choices to a real
engine and answers them whole or as server-sent events, equal to the Python API; a full queue is a 503
that leaves no job behind."""
import asyncio
import json

import pytest

pytest.importorskip("starlette")

from qlite.pipeline import load  # noqa: E402
from qlite.serve.engine import Engine  # noqa: E402
from qlite.serve.openai_api import BadRequest, plan  # noqa: E402
from qlite.serve.server import Choices  # noqa: E402

MESSAGES = [{"role": "user", "content": "the"}]


@pytest.fixture(scope="module")
def lm(tiny_ckpt):
    return load(tiny_ckpt, dtype="float32")


def choices(lm, engine, **body) -> Choices:
    body = {"messages": MESSAGES, "max_tokens": 8, **body}
    request_plan = plan(body, lm.defaults, lm.model.config.vocab_size, chat=True, tokenizer=lm.tokenizer)
    return Choices(lm, engine, request_plan, [lambda: lm.prompt_ids(MESSAGES)], chat=True)


async def still_there() -> bool:
    return False


def test_submit_then_whole_gives_each_choice_the_python_apis_answer(lm):
    engine = Engine(lm, max_batch=4, ctx=128).start()

    async def answer():
        c = choices(lm, engine, n=2, temperature=0)
        await c.submit()
        return c, await c.whole(still_there)

    try:
        c, answers = asyncio.run(answer())
    finally:
        engine.stop()
    expected = lm.generate(MESSAGES, max_new_tokens=8, temperature=0)
    assert [a["message"]["content"] for a in answers] == [expected, expected] and [a["index"] for a in answers] == [0, 1]
    usage = c.usage()
    assert usage["prompt_tokens"] == len(lm.prompt_ids(MESSAGES))  # counted once for the prompt's n choices
    assert usage["completion_tokens"] == sum(c.completion_tokens) > 0 and all(job.cancelled for job in c.jobs)


def test_stream_joins_to_the_whole_answer_and_ends_with_usage_and_done(lm):
    engine = Engine(lm, max_batch=4, ctx=128).start()

    async def events():
        c = choices(lm, engine, temperature=0)
        await c.submit()
        return c, [e async for e in c.stream({"id": "x", "object": "chat.completion.chunk"}, usage_in_stream=True)]

    try:
        c, sent = asyncio.run(events())
    finally:
        engine.stop()
    assert sent[-1] == "data: [DONE]\n\n" and all(e.startswith("data: ") and e.endswith("\n\n") for e in sent)
    chunks = [json.loads(e[6:]) for e in sent[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and chunks[0]["id"] == "x"
    text = "".join(ch["delta"].get("content", "") for chunk in chunks[1:-1] for ch in chunk["choices"])
    assert text == lm.generate(MESSAGES, max_new_tokens=8, temperature=0)
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == c.usage()


def test_a_full_queue_is_a_503_and_cancels_what_it_queued(lm):
    engine = Engine(lm, max_batch=1, ctx=64, max_queue=1)  # not started: nothing leaves the queue
    c = choices(lm, engine, n=3)
    with pytest.raises(BadRequest) as e:
        asyncio.run(c.submit())
    assert e.value.status == 503 and len(c.jobs) == 3 and all(job.cancelled for job in c.jobs)


def test_too_many_choices_are_refused_before_anything_is_queued(lm):
    engine = Engine(lm, max_batch=1, ctx=64)
    request_plan = plan({"messages": MESSAGES, "n": 16}, lm.defaults, lm.model.config.vocab_size, chat=True,
                        tokenizer=lm.tokenizer)
    with pytest.raises(BadRequest, match="at most 16 choices a request") as e:
        Choices(lm, engine, request_plan, [lambda: [1]] * 2, chat=True)
    assert e.value.param == "n"
