"""Tool calling's request checks and the markup parser (qlite/serve/tools.py), against hand-written answers."""
import json

import pytest

from qlite.errors import QliteError
from qlite.serve.tools import ToolCallText, checked_tools, tool_choice

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def split(pieces):
    text = ToolCallText()
    out = "".join(text.push(p) for p in pieces)
    return out + text.finish(), text.calls


@pytest.mark.parametrize("pieces", [
    ["Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"],
    ["Let me look.\n<", "tool_", "call>\n{\"name\": \"weather\", ", "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"],
])
def test_a_call_in_the_text_becomes_a_tool_call_however_it_streams(pieces):
    content, calls = split(pieces)
    assert content == "Let me look."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "weather", {"city": "Oslo"})]
    assert calls[0]["id"].startswith("call_")


def test_content_that_only_looks_like_markup_stays_content():
    assert split(["a < b and <tool", " is not a call"]) == ("a < b and <tool is not a call", [])
    assert split(["<tool_call>not json</tool_call> done"]) == ("<tool_call>not json</tool_call> done", [])
    two, calls = split(['<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b"}</tool_call>'])
    assert two == "" and [c["function"]["name"] for c in calls] == ["a", "b"]


def test_tool_choice_and_tools_are_checked():
    tools = checked_tools([WEATHER])
    assert tool_choice(None, tools) == "auto" and tool_choice(None, None) is None
    assert tool_choice("none", tools) is None and tool_choice("required", tools) == "required"
    assert tool_choice({"type": "function", "function": {"name": "weather"}}, tools) == "weather"
    for bad, needle in ((lambda: tool_choice("required", None), "no tools"),
                        (lambda: tool_choice({"type": "function", "function": {"name": "rain"}}, tools), "not among"),
                        (lambda: tool_choice("always", tools), "tool_choice must be"),
                        (lambda: checked_tools([{"type": "function", "function": {}}]), "tools\\[0\\]"),
                        (lambda: checked_tools([]), "non-empty")):
        with pytest.raises(QliteError, match=needle):
            bad()


def test_a_bare_call_naming_a_tool_is_a_call_and_other_json_is_content():
    text = ToolCallText(names=frozenset({"weather"}))
    out = "".join(text.push(p) for p in [' {"name": "weather", ', '"arguments": {"city": "Oslo"}}'])
    assert out + text.finish() == "" and text.calls[0]["function"]["name"] == "weather"
    for pieces in (['{"name": "rain", "arguments": {}}'], ['{"a": 1}'], ["ok ", '{"name": "weather"}']):
        text = ToolCallText(names=frozenset({"weather"}))
        assert "".join(text.push(p) for p in pieces) + text.finish() == "".join(pieces).rstrip() and not text.calls
