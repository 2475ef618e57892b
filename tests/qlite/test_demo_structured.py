"""Structured output and tools on the real demo model: a tool conversation in OpenAI's shape renders as
transformers renders the Hugging Face shape of it (the independent reference), the model's own tool call
comes back as an OpenAI tool call, and JSON-schema outputs validate (jsonschema) for 20 varied schemas."""
import json

import jsonschema
import pytest

from qlite.decode import stream_text
from qlite.messages import check_messages
from qlite.pipeline import load
from qlite.serve.tools import ToolCallText
from qlite.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
S = {"type": "string", "maxLength": 30}
SCHEMAS = [  # (prompt, schema)
    ("Is Python dynamically typed?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("How many legs does a spider have?", {"type": "object", "properties": {"legs": {"type": "integer"}}, "required": ["legs"]}),
    ("Give pi to 3 decimals.", {"type": "object", "properties": {"pi": {"type": "number"}}, "required": ["pi"]}),
    ("Pick a primary color.", {"type": "object", "properties": {"color": {"enum": ["red", "yellow", "blue"]}}, "required": ["color"]}),
    ("List three fruits.", {"type": "object", "properties": {"fruits": {"type": "array", "items": S, "minItems": 3,
                                                                         "maxItems": 3}}, "required": ["fruits"]}),
    ("Describe a book.", {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1400,
                          "maximum": 2030}, "author": S}, "required": ["title", "year", "author"], "additionalProperties": False}),
    ("Give a point in 2D.", {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                             "required": ["x", "y"], "additionalProperties": False}),
    ("Describe a user with an address.", {"type": "object", "properties": {"name": S, "address": {
        "type": "object", "properties": {"street": S, "city": S}, "required": ["street", "city"]}}, "required": ["name", "address"]}),
    ("Name a programming language and whether it is compiled.", {"type": "object", "properties": {
        "language": S, "compiled": {"type": "boolean"}}, "required": ["language", "compiled"]}),
    ("Give an HTTP status code for 'not found'.", {"type": "object", "properties": {"code": {
        "type": "integer", "minimum": 100, "maximum": 599}}, "required": ["code"]}),
    ("Write a date in ISO format.", {"type": "object", "properties": {"date": {"type": "string",
                                     "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"]}),
    ("Give a list of two tasks with priorities.", {"type": "object", "properties": {"tasks": {"type": "array", "items": {
        "type": "object", "properties": {"task": S, "priority": {"enum": ["low", "high"]}}, "required": ["task", "priority"]},
        "minItems": 2, "maxItems": 2}}, "required": ["tasks"]}),
    ("What is the capital of France?", {"type": "object", "properties": {"capital": {"const": "Paris"}}, "required": ["capital"]}),
    ("Return an id that is either a number or a string.", {"type": "object", "properties": {"id": {
        "anyOf": [{"type": "integer"}, S]}}, "required": ["id"]}),
    ("Give a middle name, or null if none.", {"type": "object", "properties": {"middle": {"type": ["string", "null"],
                                              "maxLength": 20}}, "required": ["middle"]}),
    ("Rate a movie from 1 to 5.", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                   "review": S}, "required": ["stars"]}),
    ("Give RGB values of orange.", {"type": "object", "properties": {"rgb": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 255}, "minItems": 3, "maxItems": 3}}, "required": ["rgb"]}),
    ("Summarise a function's signature.", {"type": "object", "properties": {"name": S, "args": {"type": "array", "items": S,
                                           "maxItems": 4}, "returns": S}, "required": ["name", "args", "returns"]}),
    ("Translate 'hello' to Spanish.", {"type": "object", "properties": {"word": S, "language": {"enum": ["es"]}},
                                       "required": ["word", "language"], "additionalProperties": False}),
    ("Give a version number.", {"type": "object", "properties": {"major": {"type": "integer", "minimum": 0},
                                "minor": {"type": "integer", "minimum": 0}}, "required": ["major", "minor"]}),
]


@pytest.fixture(scope="module")
def lm(demo_int4):
    return load(demo_int4)


def test_a_tool_conversation_renders_as_transformers_renders_it(demo_dir):
    from transformers import AutoTokenizer
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    openai_shape = [{"role": "developer", "content": "You help."},
                    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    hf_shape = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": '{"temp": 3}'}]
    ours = Tokenizer(demo_dir).apply_chat_template(check_messages(openai_shape), add_generation_prompt=True,
                                                   tools=[WEATHER])
    theirs = AutoTokenizer.from_pretrained(demo_dir).apply_chat_template(hf_shape, tools=[WEATHER], tokenize=False,
                                                                         add_generation_prompt=True)
    assert ours == theirs and "<tool_call>" in ours and "<tool_response>" in ours


def test_the_models_own_tool_call_comes_back_as_an_openai_call(lm):
    ids = lm.prompt_ids([{"role": "user", "content": "What is the weather in Oslo right now?"}], tools=[WEATHER])
    parser = ToolCallText(names=frozenset({"get_weather"}))
    content = "".join(parser.push(p) for p in stream_text(lm.model, lm.tokenizer, ids, lm.params(max_new_tokens=60),
                                                          lm.eos_ids)) + parser.finish()
    assert [c["function"]["name"] for c in parser.calls] == ["get_weather"], content
    assert json.loads(parser.calls[0]["function"]["arguments"])["city"] == "Oslo" and content == ""


def test_json_schema_outputs_validate_on_the_demo_model(lm):
    for prompt, schema in SCHEMAS:
        out = lm.generate(prompt + " Answer in JSON.", json_schema=schema, max_new_tokens=120)
        jsonschema.validate(json.loads(out), schema)
    assert json.loads(lm.generate("Describe a cat in JSON.", json_schema=True, max_new_tokens=200))  # json_object
