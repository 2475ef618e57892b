"""The OpenAI API's request and answer shapes for `qlite serve`, apart from HTTP: a request body checked
into a Plan (sampling settings, penalties and logit_bias, the grammar a response_format or a forced tool
call decodes under, tools, logprobs, n choices), and an Answer that turns one choice's engine events into
OpenAI's message / delta payloads (content, tool_calls, logprobs; chat and legacy completions)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from ..decode import Shaping, Text, Token
from ..errors import QliteError
from ..generate import SamplingParams
from ..messages import checked_text
from .tools import ToolCallText, checked_tools, markup_ids, tool_choice

MAX_STOPS = 4
MAX_N = 16  # choices per request (each a row of the batch)
MAX_TOP_LOGPROBS = 20
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def number(body: dict, name: str, kind, default, low=None, high=None, low_open=False, high_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise BadRequest(f"{name} must be a number", name)
    value = kind(value)
    if not math.isfinite(value) or (low is not None and (value <= low if low_open else value < low)) \
            or (high is not None and (value >= high if high_open else value > high)):
        bounds = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, " \
                 f"{high if high is not None else 'inf'}{')' if high_open or high is None else ']'}"
        raise BadRequest(f"{name} {value} is out of range {bounds}", name)
    return value


def flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {json.dumps(value)[:40]}", name)
    return value


def bad_field(name: str):
    """A QliteError from checking `name` as a 400 naming it."""
    def wrap(f, *args):
        try:
            return f(*args)
        except QliteError as e:
            raise BadRequest(str(e), name) from None
    return wrap


@dataclass
class Plan:
    """What one request asks for (checked)."""
    params: SamplingParams
    max_tokens: int | None
    speculate: bool
    shaping: Shaping  # its constraint is None: each choice gets its own from `grammar`
    n: int = 1
    grammar: str | None = None
    grammar_field: str = "response_format"  # the request field the grammar comes from (its errors name it)
    tools: list | None = None  # rendered into the prompt
    tool_mode: str | None = None  # None, "auto", "required" or a function's name
    echo: bool = False

    def tool_names(self) -> frozenset | None:
        """The functions a call may name, where the answer is parsed for calls."""
        return None if self.tool_mode is None else frozenset(t["function"]["name"] for t in self.tools)

    def choice_params(self, i: int) -> SamplingParams:
        """Choice i's settings: seeded choices draw from seed + i (else n seeded choices would be one)."""
        return self.params if i == 0 or self.params.seed is None else replace(self.params, seed=self.params.seed + i)


def plan(body: dict, defaults: dict, vocab_size: int, chat: bool, tokenizer=None) -> Plan:
    """A request body as a Plan: sampling settings, penalties, logit_bias, logprobs, n, and for chat
    response_format, tools and tool_choice (tokenizer: for the tool-call markup)."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOPS}", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1] - MAX_N):
        raise BadRequest(f"seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1] - MAX_N}", "seed")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = None if max_tokens is None else number({"max_tokens": max_tokens}, "max_tokens", int, None, low=1)
    params = SamplingParams(
        temperature=number(body, "temperature", float, defaults.get("temperature", 0.0), low=0, high=2),
        top_p=number(body, "top_p", float, defaults.get("top_p", 1.0), low=0, high=1, low_open=True),
        top_k=number(body, "top_k", int, defaults.get("top_k", 0), low=0),
        min_p=number(body, "min_p", float, defaults.get("min_p", 0.0), low=0, high=1, high_open=True),
        repetition_penalty=number(body, "repetition_penalty", float, defaults.get("repetition_penalty", 1.0),
                                  low=0, low_open=True),
        seed=seed, stop=tuple(stop))
    if chat:
        logprobs = number(body, "top_logprobs", int, 0, low=0, high=MAX_TOP_LOGPROBS) if flag(body, "logprobs") else None
        if body.get("top_logprobs") is not None and logprobs is None:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        logprobs = number(body, "logprobs", int, None, low=0, high=MAX_TOP_LOGPROBS)
    shaping = Shaping(presence_penalty=number(body, "presence_penalty", float, 0.0, low=-2, high=2),
                      frequency_penalty=number(body, "frequency_penalty", float, 0.0, low=-2, high=2),
                      logit_bias=logit_bias(body.get("logit_bias"), vocab_size), logprobs=logprobs)
    out = Plan(params, max_tokens, flag(body, "speculate", True), shaping, n=number(body, "n", int, 1, low=1, high=MAX_N))
    if chat:
        out.grammar = response_format_grammar(body.get("response_format"))
        if body.get("tools") is not None:
            out.tools = bad_field("tools")(checked_tools, body["tools"])
        out.tool_mode = bad_field("tool_choice")(tool_choice, body.get("tool_choice"), out.tools)
        if out.tool_mode not in (None, "auto"):
            from ..constrain import tool_call_grammar
            out.grammar, out.grammar_field = bad_field("tool_choice")(
                lambda: tool_call_grammar(out.tools, None if out.tool_mode == "required" else out.tool_mode,
                                          *markup_ids(tokenizer))), "tools"
        if out.tool_mode is None:
            out.tools = None  # tool_choice none: the model is not shown them
    else:
        out.echo = flag(body, "echo")
        if out.echo and logprobs is not None:
            raise BadRequest("echo with logprobs (the prompt's own) is not offered", "echo")
    return out


def logit_bias(bias, vocab_size: int) -> dict | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, as {int: float}."""
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > vocab_size:
        raise BadRequest("logit_bias must be an object of token id: bias", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < vocab_size):  # not "０"
            raise BadRequest(f"logit_bias: {key[:20]!r} is not a token id of this model (0 to {vocab_size - 1})",
                             "logit_bias")
        out[int(key)] = number({"logit_bias": value}, "logit_bias", float, 0.0, low=-100, high=100)
    return out or None


def response_format_grammar(fmt) -> str | None:
    """response_format: text (none), json_object (any JSON object) or json_schema {name, schema, strict}."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    from ..constrain import json_schema_grammar
    if kind == "json_object":
        return bad_field("response_format")(json_schema_grammar, True)
    if kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        schema = fmt["json_schema"].get("schema", {})
        return bad_field("response_format")(json_schema_grammar, schema or True, "response_format.json_schema.schema")
    raise BadRequest("response_format must be {type: text}, {type: json_object} or {type: json_schema, json_schema: "
                     "{name, schema}}", "response_format")


@dataclass
class Answer:
    """One choice's events as OpenAI payloads: `add` an event (Text, Token), `delta` what a stream sends
    now, `close` the final delta(s) at Done, `whole` the finished choice."""
    index: int
    chat: bool
    tokenizer: object
    tools: frozenset | None = None  # the functions' names: tool calls are parsed out of the text
    prefix: str = ""  # echo: the prompt text before the completion
    text: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # entries not yet sent (stream) or all (whole)
    calls: ToolCallText | None = None
    sent_prefix: bool = False

    def __post_init__(self):
        self.calls = ToolCallText(names=self.tools) if self.tools is not None else None

    def add(self, event) -> str:
        """The content this event lets out now."""
        if isinstance(event, Token):
            self.logprobs.append(event)
            return ""
        piece = event.text if isinstance(event, Text) else ""
        return self.calls.push(piece) if self.calls is not None else piece

    def delta(self, piece: str, reason: str | None = None, calls: list | None = None) -> dict:
        if not self.sent_prefix:
            piece, self.sent_prefix = self.prefix + piece, True
        pending, self.logprobs = self.logprobs, []
        if self.chat:
            body = {"content": piece} if piece else {}
            if calls:
                body["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            out = {"index": self.index, "delta": body, "finish_reason": reason}
        else:
            out = {"index": self.index, "text": piece, "finish_reason": reason}
        if pending or not self.chat:
            out["logprobs"] = self.logprobs_payload(pending) if pending else None
        return out

    def close(self, reason: str) -> dict:
        """The stream's last delta: held content, the tool calls, the finish reason."""
        rest = self.calls.finish() if self.calls is not None else ""
        calls = self.calls.calls if self.calls is not None else []
        return self.delta(rest, "tool_calls" if calls else reason, calls)

    def whole(self, pieces: str, reason: str) -> dict:
        text = self.prefix + pieces
        if self.calls is not None:
            text = self.calls.push(text) + self.calls.finish()
        calls = self.calls.calls if self.calls is not None else []
        lp = self.logprobs_payload(self.logprobs) if self.logprobs else None
        if self.chat:
            message = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            return {"index": self.index, "message": message, "logprobs": lp,
                    "finish_reason": "tool_calls" if calls else reason}
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": reason}

    def logprobs_payload(self, tokens: list[Token]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            raw = self.tokenizer.token_bytes(token_id)
            return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}
        if self.chat:
            return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                                for t in tokens]}
        strings = [self.tokenizer.token_bytes(t.id).decode("utf-8", "replace") for t in tokens]
        offsets = [sum(map(len, strings[:i])) for i in range(len(strings))]
        return {"tokens": strings, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{entry(i, lp)["token"]: lp for i, lp in t.top} for t in tokens],
                "text_offset": offsets}


def completion_prompts(prompt, vocab_size: int) -> list:
    """A completions request's prompt: text, token ids, or a list of either (a batch), as a list of
    text or id lists."""
    def one(p, what: str):
        if isinstance(p, str) and p:
            return bad_field("prompt")(checked_text, p, what)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if not all(0 <= t < vocab_size for t in p):
                raise BadRequest(f"{what}: token ids must be from 0 to {vocab_size - 1}", "prompt")
            return p
        raise BadRequest(f"{what} must be non-empty text or a list of token ids", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_N:
            raise BadRequest(f"prompt: at most {MAX_N} prompts a request", "prompt")
        return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [one(prompt, "prompt")]
