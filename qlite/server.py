"""`qlite serve`: the OpenAI HTTP API over the continuous-batching engine (engine.py).

Starlette + uvicorn (the `serve` extra): the ASGI pair vLLM and llama-cpp-python's server use; small,
well kept, server-sent events and client disconnects handled by the framework. Routes:
POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. A bad request gets a
400 in OpenAI's error shape; a full queue a 503. Chat templates render on the engine thread, so
their memory limit (chat_template.py) never overlaps another request's work.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

from .engine import Engine, Job
from .errors import QliteError
from .generate import SamplingParams
from .pipeline import check_messages

MAX_STOPS = 4


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
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed must be an integer", "seed")
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


def make_app(lm, engine: Engine, model_id: str):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
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
        stream = bool(body.get("stream", False))
        usage_in_stream = bool((body.get("stream_options") or {}).get("include_usage", False))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(prepare, emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev), **settings)
        if not engine.submit(job):
            raise BadRequest("the server is busy: its queue is full, try again later", status=503)
        first = await events.get()
        if first[0] == "error":
            raise BadRequest(first[1], "messages" if chat else "prompt")
        prompt_tokens = first[1]
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
                    if ev[0] == "text":
                        pieces.append(ev[1])
                    elif ev[0] == "error":
                        return error_response(ev[1], 500)
                    else:
                        return JSONResponse({"id": rid, "object": kind, "created": int(time.time()), "model": model_id,
                                             "choices": [choice("".join(pieces), ev[1], False)], "usage": usage(ev[2])})
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
                    if ev[0] == "text":
                        yield chunk({**head, "choices": [choice(ev[1], None, True)]})
                    elif ev[0] == "error":
                        yield chunk({"error": {"message": ev[1], "type": "server_error", "param": None, "code": None}})
                        break
                    else:
                        yield chunk({**head, "choices": [choice(None, ev[1], True)]})
                        if usage_in_stream:
                            yield chunk({**head, "choices": [], "usage": usage(ev[2])})
                        break
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled = True  # a client that left mid-stream frees its row at the next step

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def chat_completions(request: Request):
        try:
            body = await read_body(request)
            try:
                messages = check_messages(body.get("messages"))
            except QliteError as e:
                raise BadRequest(str(e), "messages") from None
            return await complete(request, body, lambda: lm.prompt_ids(messages), chat=True)
        except BadRequest as e:
            return error_response(str(e), e.status, e.param)
        except QliteError as e:
            return error_response(str(e))

    async def completions(request: Request):
        try:
            body = await read_body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest("prompt must be a non-empty string", "prompt")
            return await complete(request, body, lambda: lm.tokenizer.encode(prompt), chat=False)
        except BadRequest as e:
            return error_response(str(e), e.status, e.param)
        except QliteError as e:
            return error_response(str(e))

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
    ])


def serve(model_dir, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, ctx: int = 4096,
          max_queue: int = 64, threads: int | None = None, dtype: str = "auto", kernel: str = "auto",
          log=print) -> None:
    """Load the model, start the engine, serve until Ctrl-C (open requests finish first)."""
    try:
        import uvicorn
    except ImportError:
        raise QliteError("qlite serve needs the serve extra: pip install 'qlite[serve]' (starlette, uvicorn)") from None
    from pathlib import Path

    from .pipeline import load

    import socket
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise QliteError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    lm = load(model_dir, dtype=dtype, kernel=kernel, threads=threads)
    engine = Engine(lm, max_batch=max_batch, ctx=ctx, max_queue=max_queue).start()
    model_id = Path(model_dir).expanduser().resolve().name
    log(f"serving {model_id} on http://{host}:{port}/v1 (max batch {max_batch}, context {engine.ctx}, "
        f"KV cache {engine.cache.nbytes / 2 ** 20:.0f} MiB)")
    config = uvicorn.Config(make_app(lm, engine, model_id), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=60)
    try:
        uvicorn.Server(config).run()
    finally:
        engine.stop()
