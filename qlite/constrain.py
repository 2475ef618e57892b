"""Constrained decoding: before each token is picked, the tokens a grammar cannot take next are masked
out of the logits, so the output is in the grammar's language (a JSON schema's documents, a tool call).
The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp use): it compiles JSON schemas and
Lark grammars against the tokenizer's vocabulary and computes a step's mask in tens of microseconds. A
grammar is text (Grammar.json_schema / tool_call build it); a Constraint is one sequence's matcher."""
from __future__ import annotations

import json

import torch

from .errors import QliteError

_BITS = torch.arange(32, dtype=torch.int32)
# JSON as models write it on one line; no free whitespace, which a model can loop in (newlines forever)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(QliteError):
    """What the request's schema or grammar does (no document satisfies it, a nesting past the matcher's
    limits): the client's error, a 400 naming the field the grammar came in (Plan.grammar_field)."""
    status, code = 400, "unsupported_schema"


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise QliteError("structured output needs llguidance: pip install llguidance") from None
    return llguidance


def json_schema_grammar(schema, what: str = "json_schema") -> str:
    """The grammar of the JSON documents `schema` (a dict; True: any JSON object) allows; a schema
    llguidance cannot compile is an error naming `what`."""
    llg = _llguidance()
    if schema is True:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise QliteError(f"{what}: a JSON schema is an object")
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    except (ValueError, TypeError) as e:
        raise QliteError(f"{what}: not a usable JSON schema ({e})") from None
    return checked(grammar, what)


def tool_call_grammar(tools: list[dict], name: str | None, open_id: int, close_id: int) -> str:
    """One call of a function among `tools` (OpenAI's [{type: function, function: {name, parameters}}]),
    or of the one named, in Qwen2's markup: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    (open_id/close_id: the markup's tokens)."""
    calls, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        if name is None or function["name"] == name:
            defs[f"tool{i}"] = rooted(function.get("parameters") or {"type": "object"}, f"#/$defs/tool{i}")
            calls.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                           "arguments": {"$ref": f"#/$defs/tool{i}"}},
                          "required": ["name", "arguments"], "additionalProperties": False})
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "$defs": defs, "x-guidance": JSON_STYLE}
    lark = f'start: <[{open_id}]> "\\n" call "\\n" <[{close_id}]>\ncall: %json {json.dumps(schema)}'
    return checked(_llguidance().LLMatcher.grammar_from_lark(lark), "tools")


def rooted(schema, root: str):
    """A schema moved from a document's root to `root` (a JSON pointer such as #/$defs/tool0): every local
    $ref ("#", "#/$defs/a") re-aimed there, so a tool's parameters that refer to themselves still do inside
    the call's schema."""
    if isinstance(schema, list):
        return [rooted(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: rooted(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


def checked(grammar: str, what: str) -> str:
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise QliteError(f"{what}: {error.splitlines()[0][:300]}")
    return grammar


class Constraint:
    """One sequence's place in a grammar: `mask` the logits of its next token, `take` the token picked."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int, eos_ids):
        llg = _llguidance()
        self.matcher = llg.LLMatcher(grammar_tokenizer(tokenizer, vocab_size, eos_ids), grammar)
        self.eos = frozenset(eos_ids)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            error = self.matcher.get_error().splitlines()[0][:300]
            if "NoExtensionBias" in error:  # llguidance's word for a grammar that admits no text at all
                error = "no JSON document satisfies this schema (a $ref cycle with no way out, such as {\"$ref\": \"#\"})"
            raise GrammarError(f"structured output: {error}")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) as float32, -inf at every token the grammar cannot take next."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # (ceil(V/32),)
        self._check()
        allowed = ((words[:, None] >> _BITS) & 1).flatten()[:logits.shape[-1]].bool()  # (V,)
        return logits.float().masked_fill(~allowed, float("-inf"))

    def take(self, token: int) -> None:
        if token in self.eos and self.matcher.is_accepting():
            return
        self.matcher.consume_token(token)
        self._check()


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """The tokenizer as llguidance reads it (built once per tokenizer: about a second for 150k tokens)."""
    key = (vocab_size, tuple(sorted(eos_ids)))
    cached = getattr(tokenizer, "_grammar_tokenizer", None)
    if cached is None or cached[0] != key:
        llt = _llguidance().LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size, eos_token=list(key[1]))
        tokenizer._grammar_tokenizer = cached = (key, llt)
    return cached[1]
