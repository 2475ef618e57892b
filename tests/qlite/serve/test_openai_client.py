"""`qlite serve` driven by the official `openai` client, as agent frameworks and editors call it (a tiny
float32 model, so a batched answer is the Python API's to the bit): messages as clients send them,
logprobs against the model's own log-softmax, logit_bias, n, echo, batch and token-id prompts,
structured output that validates (jsonschema), a forced tool call and the round trip after it, model
lookup and OpenAI's error classes; each streamed and not where the API streams."""
import json

import jsonschema
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from qlite.pipeline import load  # noqa: E402
from qlite.serve.engine import Engine  # noqa: E402
from serving_checks import running  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {
    "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def lm(tiny_ckpt):
    return load(tiny_ckpt, dtype="float32")


@pytest.fixture(scope="module")
def client(lm):
    with running(lm, Engine(lm, max_batch=8, ctx=256).start()) as (port, _):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def user(text):
    return [{"role": "user", "content": text}]


def test_chat_streamed_and_not_equals_the_python_api(client, lm):
    want = lm.generate(user("the he"), max_new_tokens=10)
    got = client.chat.completions.create(model="tiny", messages=user("the he"), max_tokens=10)
    assert got.choices[0].message.content == want and got.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model="tiny", messages=user("the he"), max_tokens=10, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.total_tokens == got.usage.total_tokens
    parts = client.chat.completions.create(model="tiny", max_tokens=10, messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "the"}, {"type": "text", "text": "he"}]}])
    assert parts.choices[0].message.content == lm.generate(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the\nhe"}], max_new_tokens=10)


def test_logprobs_are_the_models_own(client, lm):
    """The first token's logprob and top 3 equal a log-softmax over the model's logits for the prompt."""
    ids = lm.prompt_ids(user("in the"))
    with torch.inference_mode():
        ref = torch.log_softmax(lm.model(torch.tensor([ids]), last_only=True)[0, -1].float(), -1)
    top = ref.topk(3)
    for stream in (False, True):
        r = client.chat.completions.create(model="tiny", messages=user("in the"), max_tokens=5, logprobs=True,
                                           top_logprobs=3, stream=stream)
        entries = [e for c in r for e in (c.choices[0].logprobs.content if c.choices and c.choices[0].logprobs
                                          else [])] if stream else r.choices[0].logprobs.content
        assert len(entries) >= 1
        first = entries[0]
        assert first.logprob == pytest.approx(float(top.values[0]), abs=1e-4)
        assert [t.logprob for t in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert bytes(first.bytes) == lm.tokenizer.token_bytes(int(top.indices[0]))
    legacy = client.completions.create(model="tiny", prompt="in the", max_tokens=4, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1 and "".join(lp.tokens) == \
        legacy.choices[0].text


def test_logit_bias_n_echo_batch_and_token_prompts(client, lm):
    forced = lm.tokenizer.encode("a")[0]
    r = client.completions.create(model="tiny", prompt="the", max_tokens=5, logit_bias={str(forced): 100})
    assert r.choices[0].text == "aaaaa"
    with torch.inference_mode():  # the greedy first token banned: the second most likely comes instead
        ref = torch.log_softmax(lm.model(torch.tensor([lm.prompt_ids("the", chat=False)]), last_only=True)[0, -1], -1)
    best = ref.topk(2)
    banned = client.completions.create(model="tiny", prompt="the", max_tokens=5, logprobs=0,
                                       logit_bias={str(int(best.indices[0])): -100})
    assert banned.choices[0].logprobs.token_logprobs[0] == pytest.approx(float(best.values[1]), abs=1e-4)
    many = client.completions.create(model="tiny", prompt=["the", lm.prompt_ids("he in", chat=False)], max_tokens=6,
                                     n=2, temperature=1.0, seed=5, echo=True)
    texts = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0].startswith("the") and texts[2].startswith("he in")
    assert texts[0] != texts[1] or texts[2] != texts[3]  # seed + i per choice: not one draw twice
    alone = client.completions.create(model="tiny", prompt="he in", max_tokens=6, temperature=1.0, seed=5)
    assert texts[2] == "he in" + alone.choices[0].text
    chat_n = client.chat.completions.create(model="tiny", messages=user("the"), max_tokens=4, n=3)
    assert [c.index for c in chat_n.choices] == [0, 1, 2] and len({c.message.content for c in chat_n.choices}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=user("the"), max_tokens=60, temperature=1.0,
                                           seed=seed, response_format=fmt, stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else r.choices[0].message.content
        jsonschema.validate(json.loads(text), WEATHER)
    r = client.chat.completions.create(model="tiny", messages=user("the"), max_tokens=60,
                                       response_format={"type": "json_object"})
    # any object: a random model's keys may run past max_tokens (the demo model's test parses them whole)
    assert r.choices[0].message.content.startswith("{")


def test_a_forced_tool_call_and_its_round_trip(client):
    for choice in ("required", {"type": "function", "function": {"name": "forecast"}}):
        r = client.chat.completions.create(model="tiny", messages=user("weather?"), tools=TOOLS, tool_choice=choice,
                                           max_tokens=120, temperature=1.0, seed=2)
        assert r.choices[0].message.tool_calls, r
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
        if choice != "required":
            assert call.function.name == "forecast"
        if call.function.name == "forecast":
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(client.chat.completions.create(model="tiny", messages=user("weather?"), tools=TOOLS, stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "forecast"}},
                                                 max_tokens=120, temperature=1.0, seed=2))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["forecast"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)
    history = [*user("weather?"), {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content is not None


def test_models_and_errors(client):
    assert client.models.retrieve("tiny").id == "tiny" and [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=user("hi"))
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user("hi"), temperature=3)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user("hi"), max_tokens=10 ** 6)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user("hi"), response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})
    assert e.value.param == "response_format"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="tiny", input="hi")


RECURSIVE = {
    "root": {"$ref": "#"},
    "defs-cycle": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "property-to-root": {"type": "object", "properties": {"child": {"$ref": "#"}, "v": {"type": "integer"}},
                         "required": ["v"]},
    "nested-arrays": {"type": "array", "items": {"$ref": "#"}},
    "linked-list": {"$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["next"]}},
        "$ref": "#/$defs/node"},
}


UNSATISFIABLE = ("root", "defs-cycle")  # no document leaves the cycle
# llguidance's lexer may give up on arrays nested without bound as the model nests them (its limit of 50,000
# items): then a 400 too, naming the field
MAY_FAIL = ("nested-arrays",)


@pytest.mark.parametrize("name", sorted(RECURSIVE))
@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_recursive_schemas_are_served_or_a_400_naming_the_field(client, name, where):
    """Recursive JSON schemas got a 500 (NoExtensionBias: a $ref cycle no document can leave). Bounded
    recursion is served (the grammar unfolds as the text nests); a schema no text satisfies is the client's
    error, a 400 naming the field it came in."""
    schema = RECURSIVE[name]
    ask = dict(model="tiny", messages=user("the"), max_tokens=40, temperature=1.0, seed=1)
    if where == "response_format":
        ask["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    else:
        ask["tools"] = [{"type": "function", "function": {"name": "r", "parameters": schema}}]
        ask["tool_choice"] = "required"
    try:
        r = client.chat.completions.create(**ask)
    except openai.BadRequestError as e:
        assert e.param == where and name in UNSATISFIABLE + MAY_FAIL, (name, e.message)
        assert ("no JSON document satisfies" in e.message) == (name in UNSATISFIABLE)
    else:
        assert name not in UNSATISFIABLE and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
