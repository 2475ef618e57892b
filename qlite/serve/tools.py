"""Tool calling as OpenAI's chat API has it, over the markup Qwen2 (and Hermes-style) chat templates
teach: the template renders `tools` into the system message, and the model answers a call as
<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>. This module checks a request's tools and
tool_choice, gives the grammar a forced call decodes under (constrain.tool_call_grammar), and turns the
markup in the output back into OpenAI `tool_calls`, streaming too (ToolCallText)."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ..errors import QliteError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def checked_tools(tools) -> list[dict]:
    """A request's `tools`: [{type: function, function: {name, description?, parameters?}}]."""
    if not isinstance(tools, list) or not tools:
        raise QliteError("tools must be a non-empty list of {type: function, function: {name, parameters}}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise QliteError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}")
        if not isinstance(function.get("parameters", {}), dict):
            raise QliteError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def tool_choice(choice, tools: list[dict] | None) -> str | None:
    """tool_choice as a mode: None (no tools: none, or no tools given), "auto", "required", or the name
    of the one function that must be called."""
    if choice is None:
        return "auto" if tools else None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise QliteError(f"tool_choice {choice}: no tools given")
        return None if choice == "none" else choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise QliteError("tool_choice must be none, auto, required or {type: function, function: {name}}")
    if not any(t["function"]["name"] == name for t in tools or ()):
        raise QliteError(f"tool_choice names {name[:100]!r}, which is not among the tools")
    return name


def markup_ids(tokenizer) -> tuple[int, int]:
    """The tokens of <tool_call> and </tool_call>; a tokenizer without them has no tool-call markup."""
    ids = tokenizer.token_id(OPEN), tokenizer.token_id(CLOSE)
    if None in ids:
        raise QliteError(f"tool_choice: this model's tokenizer has no {OPEN} token (its chat template's "
                         "tool-call markup is not Qwen2's)")
    return ids


def openai_call(text: str) -> dict | None:
    """The OpenAI tool call for the JSON between the markup, or None if it is not a call."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments", {}), dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}}


@dataclass
class ToolCallText:
    """Splits a streamed answer into content and tool calls: `push` returns the content that can go out
    now (held back: trailing whitespace and what may be the start of <tool_call>, and everything after
    one), `finish` the content still held and the calls. Markup whose JSON is not a call stays content;
    the whitespace around calls is dropped. An answer that is only a call's JSON, without the markup,
    naming one of `names`, is a call too (small Qwen2.5 models answer so: the 0.5B coder does)."""
    names: frozenset = frozenset()
    held: str = ""
    calling: bool = False
    calls: list = field(default_factory=list)
    sent: bool = False

    def push(self, text: str) -> str:
        self.held += text
        if not self.sent and self.names and self.held.lstrip().startswith("{"):
            self.calling = True  # perhaps a bare call: held to the end
        if self.calling:
            return ""
        at = self.held.find(OPEN)
        if at >= 0:
            out, self.held, self.calling = self.held[:at].rstrip(), self.held[at:], True
            return out
        keep = next((n for n in range(min(len(OPEN) - 1, len(self.held)), 0, -1) if OPEN.startswith(self.held[-n:])), 0)
        out = self.held[:len(self.held) - keep].rstrip()
        self.held, self.sent = self.held[len(out):], self.sent or bool(out.strip())
        return out

    def finish(self) -> str:
        """The content left; the calls found are in `calls`."""
        rest, content = self.held, []
        bare = openai_call(rest.strip()) if OPEN not in rest and not self.sent and self.names else None
        if bare is not None and bare["function"]["name"] in self.names:
            self.calls.append(bare)
            rest = ""
        while OPEN in rest:
            before, _, after = rest.partition(OPEN)
            body, closed, rest = after.partition(CLOSE)
            call = openai_call(body.strip()) if closed else None
            if call is None:
                content.append(before + OPEN + body + closed)
            else:
                content.append(before)
                self.calls.append(call)
        self.held = ""
        return ("".join(content) + rest).strip() if self.calls else "".join(content) + rest
