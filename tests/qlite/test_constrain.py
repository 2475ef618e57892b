"""Constrained decoding (qlite/constrain.py, llguidance): the mask allows exactly the tokens a grammar
can take, outputs validate against their schema (jsonschema, an independent validator), bad schemas
are one-line errors."""
import json

import jsonschema
import pytest
import torch

from qlite.constrain import Constraint, json_schema_grammar, tool_call_grammar
from qlite.decode import stream_text
from qlite.errors import QliteError
from qlite.pipeline import load

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "tags": {
        "type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["color", "tags"],
     "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
     "additionalProperties": False},
]


@pytest.fixture(scope="module")
def lm(tiny_ckpt):
    return load(tiny_ckpt, dtype="float32")


def test_the_mask_is_the_grammars_next_tokens(lm):
    """After '{"ok": ', only tokens that begin 'true' or 'false' are allowed (checked token by token
    against the grammar's own validation)."""
    grammar = json_schema_grammar(SCHEMAS[0])
    c = lm.constraint(grammar)
    for t in lm.tokenizer.encode('{"ok": '):
        c.take(t)
    allowed = torch.isfinite(c.mask(torch.zeros(lm.model.config.vocab_size))).nonzero().flatten().tolist()
    texts = {lm.tokenizer.decode([t]) for t in allowed}
    assert texts and all("true".startswith(s) or "false".startswith(s) for s in texts), texts
    assert {"t", "f"} <= texts


@pytest.mark.parametrize("schema", SCHEMAS, ids=["bool", "int-range", "enums", "short-string"])
def test_outputs_validate_against_their_schema(lm, schema):
    for seed in range(3):
        out = lm.generate("the", json_schema=schema, max_new_tokens=60, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(out), schema)


def test_a_forced_tool_call_is_the_markup_around_valid_arguments(lm):
    tools = [{"type": "function", "function": {"name": "pick", "parameters": SCHEMAS[2]}},
             {"type": "function", "function": {"name": "count", "parameters": SCHEMAS[1]}}]
    ids = (lm.tokenizer.token_id("<tool_call>"), lm.tokenizer.token_id("</tool_call>"))
    for name in (None, "count"):
        grammar = tool_call_grammar(tools, name, *ids)
        text = "".join(stream_text(lm.model, lm.tokenizer, lm.prompt_ids("the", chat=False),
                                   lm.params(max_new_tokens=60, temperature=1.0, seed=1), lm.eos_ids,
                                   constraint=lm.constraint(grammar)))
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
        call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
        assert call["name"] in ({"pick", "count"} if name is None else {name})
        jsonschema.validate(call["arguments"], SCHEMAS[2] if call["name"] == "pick" else SCHEMAS[1])


def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("schema, needle", [({"type": 5}, "type"), ([1], "object"),
                                            ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, ""),
                                            (nested(3000), "recursion limit exceeded"),  # oversized: refused
                                            ({"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                                               for i in range(20000)}}, "too large")])
def test_a_bad_schema_is_a_one_line_error(schema, needle):
    with pytest.raises(QliteError, match=needle) as e:
        json_schema_grammar(schema, "--json-schema s.json")
    assert str(e.value).startswith("--json-schema s.json") and "\n" not in str(e.value)


def test_json_schema_flag(tiny_ckpt, tmp_path, capsys):
    from qlite.cli import main
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[1]))
    args = ["generate", "-m", str(tiny_ckpt), "-p", "the", "--max-new-tokens", "40", "--dtype", "float32"]
    assert main([*args, "--json-schema", str(schema)]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMAS[1])
    for text in ("{not json", '{"type": 5}'):
        schema.write_text(text)
        assert main([*args, "--json-schema", str(schema)]) == 1
        err = capsys.readouterr().err
        assert str(schema) in err and err.count("\n") == 1


def test_constraint_without_the_tokenizer_cache_is_built_once(lm):
    grammar = json_schema_grammar(True)
    a, b = lm.constraint(grammar), lm.constraint(grammar)
    assert isinstance(a, Constraint) and a.matcher is not b.matcher
    assert lm.tokenizer._grammar_tokenizer is not None
