"""A conversation as OpenAI-style clients send it, checked and put in the shape chat templates take:
{role, content} messages, roles system, developer (a system message, as OpenAI's newer models name it),
user, assistant and tool; content as text or a list of text parts (joined with newlines, as vLLM
does; image, audio and file parts refused by name: a text model); `name` and `tool_call_id` accepted
and dropped (Qwen2's template shows neither); an assistant message's `tool_calls` (OpenAI's
{id, type: function, function: {name, arguments: JSON text}}) kept with arguments parsed, which is
what Hugging Face chat templates render."""
from __future__ import annotations

import json

from .errors import QliteError

ROLES = ("system", "developer", "user", "assistant", "tool")


def checked_text(text: str, what: str) -> str:
    """Text that is valid Unicode: JSON's "\\ud800" escape (or bytes not UTF-8 in argv) can give a
    string with a lone surrogate, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise QliteError(f"{what}: not valid Unicode (a lone surrogate at character {e.start})") from None
    return text


def content_text(content, what: str) -> str:
    """A message's content: text, or a list of {type: text, text} parts."""
    if isinstance(content, str):
        return checked_text(content, what)
    if not isinstance(content, list):
        raise QliteError(f"{what} must be text or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            if isinstance(kind, str) and kind != "text":
                raise QliteError(f"{what}[{j}]: a {kind[:40]} part; this model takes text parts only")
            raise QliteError(f"{what}[{j}] must be {{type: text, text: ...}}")
        texts.append(checked_text(part["text"], f"{what}[{j}].text"))
    return "\n".join(texts)


def tool_calls(calls, what: str) -> list[dict]:
    """An assistant message's tool_calls, arguments parsed from their JSON text."""
    if not isinstance(calls, list):
        raise QliteError(f"{what} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise QliteError(f"{what}[{j}] must be {{type: function, function: {{name, arguments}}}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(checked_text(arguments, f"{what}[{j}].function.arguments") or "{}")
            except ValueError:
                raise QliteError(f"{what}[{j}].function.arguments is not JSON") from None
        if not isinstance(arguments, dict):
            raise QliteError(f"{what}[{j}].function.arguments must be a JSON object")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": checked_text(function["name"], f"{what}[{j}].function.name"),
                                 "arguments": arguments}})
    return out


def check_messages(messages) -> list[dict]:
    """A conversation as the chat template takes it: a non-empty list of messages, each of a known role
    with text content (an assistant message may have tool_calls instead)."""
    if not isinstance(messages, list) or not messages:
        raise QliteError("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise QliteError(f"messages[{i}] must be {{role: {'|'.join(ROLES)}, content}}")
        role, calls = m["role"], m.get("tool_calls")
        message = {"role": "system" if role == "developer" else role}
        if role == "assistant" and calls:
            message["tool_calls"] = tool_calls(calls, f"messages[{i}].tool_calls")
            message["content"] = "" if m.get("content") is None else content_text(m["content"], f"messages[{i}].content")
        else:
            message["content"] = content_text(m.get("content"), f"messages[{i}].content")
        out.append(message)
    return out
