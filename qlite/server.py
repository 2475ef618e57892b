"""`qlite serve`: the OpenAI HTTP API over the continuous-batching engine (engine.py).

Starlette + uvicorn (the `serve` extra): the ASGI pair vLLM and llama-cpp-python's server use; small,
well kept, server-sent events and client disconnects handled by the framework. Routes:
POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. A bad request gets a
400 in OpenAI's error shape; a full queue a 503; every other status (404, 405, 413, 500) the same
JSON shape. A request's failure is its own: nothing it sends reaches another request. Chat
templates render on the engine thread, so their memory limit (chat_template.py) never overlaps
another request's work.

Limits (Limits, `qlite serve` flags): a request body of at most --max-body-bytes (413 past it); a
connection that sends nothing for --timeout seconds (no request yet, or a request half sent) is
closed; at most --max-connections open at once (more are closed as they arrive, before they hold
anything).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass

from .decode import Failed, Text
from .engine import Engine, Job
from .errors import QliteError
from .generate import SamplingParams
from .pipeline import check_messages, checked_text

MAX_STOPS = 4
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes
log = logging.getLogger("qlite.serve")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * 2**20  # a 32k-token conversation is ~150 KB of JSON
    timeout_s: float = 30.0  # a connection that sends nothing this long is closed
    max_connections: int = 256  # open at once


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_response(message: str, status: int = 400, param: str | None = None):
    from starlette.responses import JSONResponse
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def _number(body: dict, name: str, kind, default, low=None, high=None, low_open=False, high_open=False):
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


def job_settings(body: dict, defaults: dict) -> dict:
    """SamplingParams and penalties from an OpenAI request body (checked)."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOPS}", "stop")
    if _number(body, "n", int, 1, low=1) != 1:
        raise BadRequest("n: qlite returns one choice per request", "n")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise BadRequest(f"seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}", "seed")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = None if max_tokens is None else _number({"max_tokens": max_tokens}, "max_tokens", int, None, low=1)
    params = SamplingParams(
        temperature=_number(body, "temperature", float, defaults.get("temperature", 0.0), low=0),
        top_p=_number(body, "top_p", float, defaults.get("top_p", 1.0), low=0, high=1, low_open=True),
        top_k=_number(body, "top_k", int, defaults.get("top_k", 0), low=0),
        min_p=_number(body, "min_p", float, defaults.get("min_p", 0.0), low=0, high=1, high_open=True),
        repetition_penalty=_number(body, "repetition_penalty", float, defaults.get("repetition_penalty", 1.0),
                                   low=0, low_open=True),
        seed=seed, stop=tuple(stop))
    return {"params": params, "max_tokens": max_tokens,
            "presence_penalty": _number(body, "presence_penalty", float, 0.0, low=-2, high=2),
            "frequency_penalty": _number(body, "frequency_penalty", float, 0.0, low=-2, high=2)}


def flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {json.dumps(value)[:40]}", name)
    return value


def isolated(handler):
    """A route whose every failure is this request's own answer in OpenAI's error shape: a bad
    request a 4xx, anything else a 500 with one log line, never a traceback or another request's."""
    import functools

    @functools.wraps(handler)
    async def run(request):
        try:
            return await handler(request)
        except BadRequest as e:
            return error_response(str(e), e.status, e.param)
        except QliteError as e:
            return error_response(str(e))
        except Exception as e:  # a bug: this request fails, the server goes on
            log.error("%s %s: internal error: %s: %s", request.method, request.url.path, type(e).__name__, e)
            return error_response(f"internal error: {type(e).__name__}", 500)
    return run


def make_app(lm, engine: Engine, model_id: str, limits: Limits = Limits()):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())

    async def read_body(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise BadRequest(f"the body is {declared} bytes, more than this server takes ({limits.max_body_bytes}; "
                             "qlite serve --max-body-bytes)", status=413)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise BadRequest(f"the body is more than this server takes ({limits.max_body_bytes} bytes; "
                                     "qlite serve --max-body-bytes)", status=413)
                chunks.append(chunk)
        except ClientDisconnect:
            raise BadRequest("the client left before sending the whole body", status=400) from None
        try:
            body = json.loads(b"".join(chunks))
        except RecursionError:
            raise BadRequest("the body is not valid JSON (nested too deeply)") from None
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        if body.get("model") not in (None, model_id):
            raise BadRequest(f"model {body.get('model')!r} is not served here (this server has {model_id!r})",
                             "model")
        return body

    async def complete(request: Request, body: dict, prepare, chat: bool):
        settings = job_settings(body, lm.defaults)
        stream = flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        usage_in_stream = flag(options, "include_usage")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(prepare, emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev), **settings)
        if not engine.submit(job):
            raise BadRequest("the server is busy: its queue is full, try again later", status=503)
        first = await events.get()
        if isinstance(first, Failed):
            raise BadRequest(first.message, "messages" if chat else "prompt", status=first.status)
        prompt_tokens = first.prompt_tokens
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, reason: str | None, delta: bool):
            if chat:
                body = {"role": "assistant", "content": text} if not delta else ({} if text is None else {"content": text})
                return {"index": 0, ("delta" if delta else "message"): body, "finish_reason": reason}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

        def usage(completion: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}

        if not stream:
            pieces = []
            try:
                while True:
                    try:
                        ev = await asyncio.wait_for(events.get(), 1.0)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            job.cancelled = True
                            return JSONResponse({}, 499)
                        continue
                    if isinstance(ev, Text):
                        pieces.append(ev.text)
                    elif isinstance(ev, Failed):
                        return error_response(ev.message, ev.status)
                    else:
                        return JSONResponse({"id": rid, "object": kind, "created": int(time.time()), "model": model_id,
                                             "choices": [choice("".join(pieces), ev.reason, False)],
                                             "usage": usage(ev.completion_tokens)})
            finally:
                job.cancelled = True  # no-op once done; frees the row if the handler was cancelled

        async def sse():
            def chunk(payload: dict) -> str:
                return f"data: {json.dumps(payload)}\n\n"

            head = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": int(time.time()),
                    "model": model_id}
            try:
                if chat:
                    yield chunk({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]})
                while True:
                    ev = await events.get()
                    if isinstance(ev, Text):
                        yield chunk({**head, "choices": [choice(ev.text, None, True)]})
                    elif isinstance(ev, Failed):
                        yield chunk({"error": {"message": ev.message, "type": "server_error", "param": None, "code": None}})
                        break
                    else:
                        yield chunk({**head, "choices": [choice(None, ev.reason, True)]})
                        if usage_in_stream:
                            yield chunk({**head, "choices": [], "usage": usage(ev.completion_tokens)})
                        break
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled = True  # a client that left mid-stream frees its row at the next step

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @isolated
    async def chat_completions(request: Request):
        body = await read_body(request)
        try:
            messages = check_messages(body.get("messages"))
        except QliteError as e:
            raise BadRequest(str(e), "messages") from None
        return await complete(request, body, lambda: lm.prompt_ids(messages), chat=True)

    @isolated
    async def completions(request: Request):
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string", "prompt")
        try:
            checked_text(prompt, "prompt")
        except QliteError as e:
            raise BadRequest(str(e), "prompt") from None
        return await complete(request, body, lambda: lm.prompt_ids(prompt, chat=False), chat=False)

    async def http_error(request: Request, exc: HTTPException):
        return error_response(exc.detail, exc.status_code)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                                        "owned_by": "qlite"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok", **engine.load()})

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error})


def guarded_protocol(limits: Limits):
    """uvicorn's HTTP/1.1 protocol with a connection cap (a connection past it is closed as it arrives)
    and a read timeout (one that sends nothing for timeout_s while no request is being answered is
    closed: an idle client, or a request half sent)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        def connection_made(self, transport):
            if len(self.connections) >= limits.max_connections:
                transport.abort()  # before it holds anything; the client sees a closed connection
                return
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is None or self.cycle.more_body:  # still reading a request
                self._arm()

        def _arm(self) -> None:
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(limits.timeout_s, self._idle)

        def _idle(self) -> None:
            if self.cycle is None or self.cycle.more_body or self.cycle.response_complete:
                self.transport.close()  # a request half sent, or none: no answer is owed

    return Guarded


def server_config(app, host: str, port: int, limits: Limits = Limits(), **options):
    """The uvicorn config qlite serves with: its guarded protocol and the same keep-alive bound."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits), timeout_keep_alive=int(max(
        1, min(limits.timeout_s, 5))), log_level="warning", **options)


def open_files_for(limits: Limits) -> None:
    """Room for max_connections sockets beside the model's files: the soft open-file limit raised as
    far as the hard one allows, or a one-line error naming the flag."""
    try:
        import resource
    except ImportError:
        return
    need = limits.max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise QliteError(f"--max-connections {limits.max_connections}: this process may open {hard} files "
                             f"(ulimit -n), fewer than the {need} it needs")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def serve(model_dir, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, ctx: int = 4096,
          max_queue: int = 64, threads: int | None = None, dtype: str = "auto", kernel: str = "auto",
          log=print, limits: Limits = Limits(), kv_cache: str = "bf16") -> None:
    """Load the model, start the engine, serve until Ctrl-C (open requests finish first)."""
    try:
        import uvicorn
    except ImportError:
        raise QliteError("qlite serve needs the serve extra: pip install 'qlite[serve]' (starlette, uvicorn)") from None
    from pathlib import Path

    from .pipeline import load

    import socket
    open_files_for(limits)
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise QliteError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    lm = load(model_dir, dtype=dtype, kernel=kernel, threads=threads, kv_cache=kv_cache)
    from .fit import check_fits
    check_fits(model_dir, lm.model, min(ctx, lm.model.config.context_length), "--ctx", batch=max_batch)
    engine = Engine(lm, max_batch=max_batch, ctx=ctx, max_queue=max_queue).start()
    model_id = Path(model_dir).expanduser().resolve().name
    log(f"serving {model_id} on http://{host}:{port}/v1 (max batch {max_batch}, context {engine.ctx}, "
        f"KV cache {kv_cache} {engine.cache.cache.nbytes / 2 ** 20:.0f} MiB; bodies up to {limits.max_body_bytes} bytes, "
        f"{limits.max_connections} connections, {limits.timeout_s:g} s idle timeout)")
    config = server_config(make_app(lm, engine, model_id, limits), host, port, limits, timeout_graceful_shutdown=60)
    try:
        uvicorn.Server(config).run()
    finally:
        engine.stop()
