"""`qlite serve`: the OpenAI HTTP API over the continuous-batching engine (engine.py).

Starlette + uvicorn (the `serve` extra): the ASGI pair vLLM and llama-cpp-python's server use; small,
well kept, server-sent events and client disconnects handled by the framework. Routes:
POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id}, GET /health,
POST /v1/embeddings as a 404 saying it is not offered, and GET / the chat page (webui.html; --no-webui
turns it off). What a body asks and how answers look is
openai_api.py's; here: HTTP, a job per choice, streaming. A bad request gets a 400 in OpenAI's error
shape; a full queue a 503; every other status (401, 404, 405, 413, 500) the same JSON shape. With
`--speculate`, a request decodes by speculation while it is alone in the batch (`"speculate": false` in
its body opts out) and its usage gains `speculation` (passes, proposed and accepted tokens, tokens per
pass). A request's failure is its own: nothing it sends reaches another request. Chat templates
render on the engine thread, so their memory limit (chat_template.py) never overlaps another request's
work; a grammar compiles in a worker thread, off the event loop.

Limits (Limits, `qlite serve` flags): a request body of at most --max-body-bytes (413 past it); a
connection that sends nothing for --timeout seconds (no request yet, or a request half sent) is
closed; at most --max-connections open at once (more are closed as they arrive, before they hold
anything).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from ..constrain import GrammarError
from ..decode import Done, Failed, Start, Token
from ..errors import QliteError
from ..messages import check_messages
from .engine import Engine, Job
from .openai_api import MAX_N, Answer, BadRequest, Plan, bad_field, completion_prompts, flag, plan

log = logging.getLogger("qlite.serve")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * 2**20  # a 32k-token conversation is ~150 KB of JSON
    timeout_s: float = 30.0  # a connection that sends nothing this long is closed
    max_connections: int = 256  # open at once


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None):
    from starlette.responses import JSONResponse
    kind = {401: "authentication_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def isolated(handler):
    """A route whose every failure is this request's own answer in OpenAI's error shape: a bad
    request a 4xx, anything else a 500 with one log line, never a traceback or another request's."""
    import functools

    @functools.wraps(handler)
    async def run(request):
        try:
            return await handler(request)
        except BadRequest as e:
            return error_response(str(e), e.status, e.param, e.code)
        except QliteError as e:
            return error_response(str(e))
        except Exception as e:  # a bug: this request fails, the server goes on
            log.error("%s %s: internal error: %s: %s", request.method, request.url.path, type(e).__name__, e)
            return error_response(f"internal error: {type(e).__name__}", 500)
    return run


class KeyGuard:
    """ASGI middleware: every /v1/ request (but a CORS preflight) must carry `Authorization: Bearer KEY`;
    others get a 401 in OpenAI's error shape (code invalid_api_key). /health stays open."""

    def __init__(self, app, key: str):
        self.app, self.want = app, b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.want):
                response = error_response("a valid API key is needed: Authorization: Bearer KEY (qlite serve "
                                          "--api-key)", 401, code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?")


def check_origin(origin: str) -> None:
    """--cors ORIGIN: * or a browser origin, scheme://host[:port] with nothing after (what an Origin header holds)."""
    if origin != "*" and not ORIGIN.fullmatch(origin):
        raise QliteError(f"--cors {origin[:80]!r}: an origin is scheme://host[:port], as https://app.example or "
                         f"http://localhost:3000 (or * for any)")


class Choices:
    """One request's choices in the engine: a job per prompt and choice, their events in one queue (each
    choice's in the engine's order), the Answer that shapes each into OpenAI's JSON. submit() queues them
    and waits for each to start; then whole() or stream() answers; cancel() frees their rows."""

    def __init__(self, lm, engine: Engine, plan: Plan, prompts: list, chat: bool, echoes: list | None = None):
        if len(prompts) * plan.n > MAX_N:
            raise BadRequest(f"{len(prompts)} prompts x n {plan.n}: at most {MAX_N} choices a request", "n")
        self.lm, self.engine, self.plan, self.prompts, self.chat, self.echoes = lm, engine, plan, prompts, chat, echoes
        self.jobs, self.answers, self.early = [], [], []  # early: events that came before every job started
        self.events: asyncio.Queue = asyncio.Queue()  # (choice index, event)
        self.prompt_tokens = self.cached_tokens = 0
        self.completion_tokens: list[int] = []

    async def submit(self) -> None:
        """Queue a job per choice (a grammar compiled for each, off the event loop; one no text satisfies
        is a 400), then wait for each job's first event. A full queue is a 503, a prompt that fails its
        own 4xx; either cancels every job."""
        loop, plan = asyncio.get_running_loop(), self.plan
        for p, prepare in enumerate(self.prompts):
            for j in range(plan.n):
                index = len(self.jobs)
                constraint = None if plan.grammar is None else await asyncio.to_thread(
                    bad_field(plan.grammar_field), self.lm.constraint, plan.grammar)
                self.jobs.append(Job(prepare, plan.choice_params(j), lambda ev, i=index: loop.call_soon_threadsafe(
                    self.events.put_nowait, (i, ev)), plan.max_tokens, replace(plan.shaping, constraint=constraint),
                    plan.speculate))
                self.answers.append(Answer(index, self.chat, self.lm.tokenizer, tools=plan.tool_names(),
                                           prefix=self.echoes[p] if self.echoes else ""))
        self.completion_tokens = [0] * len(self.jobs)
        for job in self.jobs:
            if not self.engine.submit(job):
                self.cancel()
                raise BadRequest("the server is busy: its queue is full, try again later", status=503)
        for _ in self.jobs:  # each job's first event: Start, or why it failed
            while True:
                i, ev = await self.events.get()
                if isinstance(ev, (Start, Failed)):
                    break
                self.early.append((i, ev))
            if isinstance(ev, Failed):
                self.cancel()
                raise BadRequest(ev.message, self.failed_param(ev, "messages" if self.chat else "prompt"), ev.status,
                                 ev.code)
            self.prompt_tokens += ev.prompt_tokens if i % plan.n == 0 else 0
            self.cached_tokens += ev.cached_tokens if i % plan.n == 0 else 0
        self.early.reverse()

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled = True  # no-op once done; frees a row if the answer was abandoned

    def failed_param(self, ev: Failed, otherwise: str | None = None) -> str | None:
        """The request field a failure is about."""
        return self.plan.grammar_field if ev.code == GrammarError.code else otherwise

    async def next_event(self):
        return self.early.pop() if self.early else await self.events.get()

    def usage(self) -> dict:
        total = sum(self.completion_tokens)
        extras = [job.speculator.stats.usage() for job in self.jobs if job.speculator is not None]
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": total,
                "total_tokens": self.prompt_tokens + total, "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                **({"speculation": extras[0] if len(extras) == 1 else extras} if extras else {})}

    async def whole(self, disconnected) -> list[dict] | None:
        """Every choice's whole answer, in order; None if the client left first (`disconnected`: an async
        check, asked each second of waiting). A choice that fails is this request's error (BadRequest)."""
        pieces, choices = [[] for _ in self.jobs], {}
        try:
            while len(choices) < len(self.jobs):
                try:
                    i, ev = await asyncio.wait_for(self.next_event(), 1.0)
                except asyncio.TimeoutError:
                    if await disconnected():
                        return None
                    continue
                if isinstance(ev, Failed):
                    raise BadRequest(ev.message, self.failed_param(ev), ev.status, ev.code)
                if isinstance(ev, Done):
                    self.completion_tokens[i] = ev.completion_tokens
                    choices[i] = self.answers[i].whole("".join(pieces[i]), ev.reason)
                else:
                    self.answers[i].add(ev) if isinstance(ev, Token) else pieces[i].append(ev.text)
            return [choices[i] for i in range(len(self.jobs))]
        finally:
            self.cancel()

    async def stream(self, head: dict, usage_in_stream: bool):
        """The answer as server-sent events: chunks carrying `head` (id, object, created, model), a
        choice's failure as an error event, the usage chunk if asked, then [DONE]. A client that leaves
        mid-stream frees its rows at the next step."""
        def chunk(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if self.chat:
                yield chunk({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "finish_reason": None} for i in range(len(self.jobs))]})
            done = 0
            while done < len(self.jobs):
                i, ev = await self.next_event()
                if isinstance(ev, Failed):
                    yield chunk({"error": {"message": ev.message, "param": self.failed_param(ev), "code": ev.code,
                                           "type": "invalid_request_error" if ev.status < 500 else "server_error"}})
                    break
                if isinstance(ev, Done):
                    self.completion_tokens[i], done = ev.completion_tokens, done + 1
                    yield chunk({**head, "choices": [self.answers[i].close(ev.reason)]})
                elif piece := self.answers[i].add(ev):
                    yield chunk({**head, "choices": [self.answers[i].delta(piece)]})
            else:
                if usage_in_stream:
                    yield chunk({**head, "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()


class Api:
    """The HTTP API over one engine: each route a method (a request's body read within the limits, its
    choices submitted and answered whole or streamed). names: the model's name, or the names it answers
    to (the first is the one answers carry); a request naming another model gets 404 model_not_found,
    as OpenAI's API and vLLM answer."""

    def __init__(self, lm, engine: Engine, names, limits: Limits = Limits()):
        self.lm, self.engine, self.limits = lm, engine, limits
        self.names = (names,) if isinstance(names, str) else tuple(names)
        self.created = int(time.time())

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "qlite"}

    def unknown_model(self, name) -> BadRequest:
        return BadRequest(f"model {str(name)[:200]!r} is not served here (this server answers to "
                          f"{', '.join(map(repr, self.names))}; qlite serve --served-model-name)", "model", 404,
                          "model_not_found")

    async def read_body(self, request) -> dict:
        """The request's JSON object, read at most --max-body-bytes deep (413 past it), its model checked."""
        from starlette.requests import ClientDisconnect

        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"the body is {declared} bytes, more than this server takes ({limit}; "
                             "qlite serve --max-body-bytes)", status=413)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BadRequest(f"the body is more than this server takes ({limit} bytes; "
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
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise BadRequest(f"model must be a string, got {json.dumps(body['model'])[:40]}", "model")
        if body.get("model") is not None and body.get("model") not in self.names:
            raise self.unknown_model(body.get("model"))
        return body

    async def complete(self, request, body: dict, plan: Plan, prompts: list, chat: bool, echoes: list | None = None):
        """Answer a request: each prompt (a `prepare` for the engine) n times, whole or streamed."""
        from starlette.responses import JSONResponse, StreamingResponse

        stream = flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        usage_in_stream = flag(options, "include_usage")
        choices = Choices(self.lm, self.engine, plan, prompts, chat, echoes)
        await choices.submit()
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": ("chat.completion" if chat else "text_completion") + (".chunk" if stream and chat else ""),
                "created": int(time.time()), "model": self.names[0]}
        if stream:
            return StreamingResponse(choices.stream(head, usage_in_stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        answers = await choices.whole(request.is_disconnected)
        if answers is None:
            return JSONResponse({}, 499)
        return JSONResponse({**head, "created": int(time.time()), "choices": answers, "usage": choices.usage()})

    async def chat_completions(self, request):
        lm = self.lm
        body = await self.read_body(request)
        messages = bad_field("messages")(check_messages, body.get("messages"))
        request_plan = plan(body, lm.defaults, lm.model.config.vocab_size, chat=True, tokenizer=lm.tokenizer)
        tools = request_plan.tools
        return await self.complete(request, body, request_plan, [lambda: lm.prompt_ids(messages, tools=tools)],
                                   chat=True)

    async def completions(self, request):
        lm = self.lm
        body = await self.read_body(request)
        request_plan = plan(body, lm.defaults, lm.model.config.vocab_size, chat=False)
        prompts = completion_prompts(body.get("prompt"), lm.model.config.vocab_size)
        prepares = [(lambda ids=p: list(ids)) if isinstance(p, list) else (lambda text=p: lm.prompt_ids(text, chat=False))
                    for p in prompts]
        echoes = [lm.tokenizer.decode(p) if isinstance(p, list) else p for p in prompts] if request_plan.echo else None
        return await self.complete(request, body, request_plan, prepares, chat=False, echoes=echoes)

    async def models(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse({"object": "list", "data": [self.model_card(name) for name in self.names]})

    async def model(self, request):
        from starlette.responses import JSONResponse
        name = request.path_params["name"]
        if name not in self.names:
            raise self.unknown_model(name)
        return JSONResponse(self.model_card(name))

    async def embeddings(self, request):
        return error_response("qlite serve does not offer embeddings: a generative model's hidden states are not a "
                              "trained embedding model's", 404, code="not_offered")

    async def health(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse({"status": "ok", **self.engine.load()})

    def app(self, api_key: str | None = None, cors: tuple = (), webui: bool = True):
        """The ASGI app: the routes, the JSON error shape for every status, CORS and the key if asked."""
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware
        from starlette.responses import Response
        from starlette.routing import Route

        page = (Path(__file__).parent / "webui.html").read_bytes() if webui else b""

        async def chat_page(request):  # static: the page asks /v1/ itself, with the key the user gives it
            return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

        async def http_error(request, exc: HTTPException):
            return error_response(exc.detail, exc.status_code)

        return Starlette(routes=[
            *([Route("/", chat_page, methods=["GET"])] if webui else []),
            Route("/v1/chat/completions", isolated(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", isolated(self.completions), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{name:path}", isolated(self.model), methods=["GET"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={HTTPException: http_error}, middleware=[
            *([Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST", "OPTIONS"],
                          allow_headers=["*"])] if cors else []),
            *([Middleware(KeyGuard, key=api_key)] if api_key else [])])


def make_app(lm, engine: Engine, names, limits: Limits = Limits(), api_key: str | None = None, cors: tuple = (),
             webui: bool = True):
    """The ASGI app of an Api over the engine (see Api and Api.app)."""
    return Api(lm, engine, names, limits).app(api_key, cors, webui)


# the chat page runs only its own inline script and talks only to this server
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


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

        def send_400_response(self, msg: str) -> None:
            """Malformed HTTP, which never reaches the app: the same JSON error shape as every other answer
            (uvicorn's own is plain text)."""
            import h11
            body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}", "type": "invalid_request_error",
                                         "param": None, "code": None}}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

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
          log=print, limits: Limits = Limits(), kv_cache: str = "bf16", speculate: str | None = None,
          draft_tokens: int = 7, served_model_names: tuple = (), api_key: str | None = None, cors: tuple = (),
          prompt_cache_mib: int = 256, prefill_chunk: int = 256, webui: bool = True) -> None:
    """Load the model, start the engine, serve until Ctrl-C (open requests finish first)."""
    try:
        import uvicorn
    except ImportError:
        raise QliteError("qlite serve needs the serve extra: pip install 'qlite[serve]' (starlette, uvicorn)") from None
    from ..pipeline import load

    import socket
    if api_key is not None and not api_key.strip():
        raise QliteError("--api-key: empty (give the key clients will send, or leave the flag out)")
    for origin in cors:
        check_origin(origin)
    open_files_for(limits)
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise QliteError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None

    def build() -> Engine:  # on the engine's thread (Engine.on_own_thread): the model's work all starts there
        from ..fit import check_fits
        from ..speculate import speculation
        lm = load(model_dir, dtype=dtype, kernel=kernel, threads=threads, kv_cache=kv_cache)
        check_fits(model_dir, lm.model, min(ctx, lm.model.config.context_length), "--ctx", batch=max_batch)
        return Engine(lm, max_batch=max_batch, ctx=ctx, max_queue=max_queue,
                      speculation=speculation(speculate, lm, draft_tokens), prompt_cache_bytes=prompt_cache_mib << 20,
                      prefill_chunk=prefill_chunk)

    engine = Engine.on_own_thread(build)
    lm = engine.lm
    names = tuple(served_model_names) or (Path(model_dir).expanduser().resolve().name,)
    model_id = ", ".join(names)
    log(f"serving {model_id} on http://{host}:{port}/v1 (max batch {max_batch}, context {engine.ctx}, "
        f"KV cache {kv_cache} up to {engine.cache.cache.nbytes / engine.cache.cache.capacity * engine.ctx / 2 ** 20:.0f} MiB, "
        f"as used; bodies up to {limits.max_body_bytes} bytes, "
        f"{limits.max_connections} connections, {limits.timeout_s:g} s idle timeout)")
    if engine.prompt_cache_off:
        log(f"prompt cache: off, {engine.prompt_cache_off}")
    log("authentication: a Bearer API key is required on /v1/" if api_key else
        "authentication: none, any client that reaches the port may call /v1/ (--api-key or QLITE_API_KEY to require a key)")
    if webui:
        log(f"chat page: http://{host}:{port}/")
    app = make_app(lm, engine, names, limits, api_key=api_key, cors=tuple(cors), webui=webui)
    config = server_config(app, host, port, limits, timeout_graceful_shutdown=60)
    try:
        uvicorn.Server(config).run()
    finally:
        engine.stop()
