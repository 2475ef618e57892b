"""qlite serve against a real server on 127.0.0.1 with a tiny checkpoint, called with a plain HTTP
client: answers equal the Python API's, streams join to them, batching is exact, bad requests get
OpenAI-shaped 400s, a client that leaves frees its row, Ctrl-C exits 130."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from qlite import native  # noqa: E402
from qlite.pipeline import load  # noqa: E402
from qlite.serve.engine import Engine  # noqa: E402
from serving_checks import LIMITS, free_port, running  # noqa: E402
from tests.tiny_models import NATIVE_WIDTHS, make_checkpoint  # noqa: E402


PROMPTS = ["the", "he in", "a", "the the", "in the he", "he", "t", "a the in"]


@pytest.fixture(scope="module")
def lm(tiny_ckpt):
    return load(tiny_ckpt, dtype="float32")


@pytest.fixture(scope="module")
def server(lm):
    with running(lm, Engine(lm, max_batch=8, ctx=128, max_queue=4).start()) as port_engine:
        yield port_engine


def call(port, path, body=None, raw: bytes | None = None, method="POST", headers=None, response=False):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    return (r.status, payload, r) if response else (r.status, payload)


def chat(port, content, **extra):
    status, payload = call(port, "/v1/chat/completions",
                           {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra})
    assert status == 200, payload
    return json.loads(payload)


def stream_pieces(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def native_lm(tmp_path_factory):
    """An int4 model on native widths in bf16: its prefills are row-exact, so its server keeps a prompt cache
    (the float32 `lm`'s stays off: engine.py)."""
    from quantize.convert import convert
    src = make_checkpoint(tmp_path_factory.mktemp("native") / "bf16", **NATIVE_WIDTHS)
    return load(convert(src, src.parent / "int4", bits=4, group_size=128, progress=False).out_dir, dtype="bfloat16")


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here: no prompt cache")
def test_chat_answer_and_stream_equal_the_python_api(native_lm):
    lm = native_lm
    with running(lm, Engine(lm, max_batch=8, ctx=128, max_queue=4).start()) as (port, _):
        check_chat_answer_and_stream(port, lm)


def check_chat_answer_and_stream(port, lm):
    want = lm.generate([{"role": "user", "content": "the"}], max_new_tokens=12)
    got = chat(port, "the", max_tokens=12)
    assert got["object"] == "chat.completion" and got["choices"][0]["message"] == {"role": "assistant",
                                                                                  "content": want}
    assert got["choices"][0]["finish_reason"] in ("stop", "length")
    assert got["usage"]["prompt_tokens"] == len(lm.prompt_ids([{"role": "user", "content": "the"}]))
    assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] + got["usage"]["completion_tokens"]
    chunks = stream_pieces(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "the"}],
                                                          "max_tokens": 12, "stream_options": {"include_usage": True}})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == want
    cached = chunks[-1]["usage"].pop("prompt_tokens_details")["cached_tokens"]  # the same prompt again: from the cache
    assert got["usage"].pop("prompt_tokens_details") == {"cached_tokens": 0} and cached == got["usage"]["prompt_tokens"] - 1
    assert chunks[-1]["usage"] == got["usage"]


def test_completions_models_health(server, lm):
    port, _ = server
    want = lm.generate("the he", chat=False, max_new_tokens=8)
    status, payload = call(port, "/v1/completions", {"prompt": "the he", "max_tokens": 8})
    assert status == 200 and json.loads(payload)["choices"][0]["text"] == want
    chunks = stream_pieces(port, "/v1/completions", {"prompt": "the he", "max_tokens": 8})
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    status, payload = call(port, "/v1/models", method="GET")
    assert status == 200 and json.loads(payload)["data"][0]["id"] == "tiny"
    status, payload = call(port, "/health", method="GET")
    assert status == 200 and json.loads(payload)["status"] == "ok"


def test_sampling_settings_and_stop(server, lm):
    port, _ = server
    a = chat(port, "the", temperature=1.0, top_p=0.9, min_p=0.05, seed=3, max_tokens=10)
    b = chat(port, "the", temperature=1.0, top_p=0.9, min_p=0.05, seed=3, max_tokens=10)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]  # a seed makes it reproducible
    full = chat(port, "the", max_tokens=12)["choices"][0]["message"]["content"]
    if len(full) > 3:
        stop = full[2:4]
        cut = chat(port, "the", max_tokens=12, stop=[stop])["choices"][0]
        assert cut["message"]["content"] == full[:full.find(stop)] and cut["finish_reason"] == "stop"
    penalized = chat(port, "the", max_tokens=12, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5)
    assert penalized["usage"]["completion_tokens"] >= 1


def test_concurrent_requests_are_exact(server, lm):
    """8 different prompts at once decode together; each answer equals that prompt alone."""
    port, engine = server
    want = [lm.generate([{"role": "user", "content": p}], max_new_tokens=16) for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: chat(port, p, max_tokens=16)["choices"][0]["message"]["content"], PROMPTS))
    assert got == want


@pytest.mark.parametrize("body, raw, param", [
    (None, b"{not json", None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, None, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, None, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, None, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None, "messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
                   {"role": "user", "content": "hi"}]}, None, "messages"),
    ({"messages": "hi"}, None, "messages"),
    ({"messages": [{"role": "user"}]}, None, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, None, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, None, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, None, "stop"),
    ([1, 2], None, None),
])
def test_bad_requests_get_400(server, body, raw, param):
    port, engine = server
    status, payload = call(port, "/v1/chat/completions", body, raw=raw)
    assert status == 400, payload
    error = json.loads(payload)["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert engine.load()["active"] == 0


def test_a_client_that_leaves_frees_its_row(server):
    port, engine = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "the", "max_tokens": 120, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    r.fp.readline()  # the first event
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 20
    while engine.load()["active"] and time.time() < deadline:
        time.sleep(0.05)
    load = engine.load()
    assert {k: load[k] for k in ("active", "waiting", "max_batch", "ctx")} == {"active": 0, "waiting": 0, "max_batch": 8,
                                                                             "ctx": 128}


def test_serve_command_exits_130_on_ctrl_c(tiny_ckpt):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-m", "qlite", "serve", "-m", str(tiny_ckpt), "--port", str(port),
                             "--ctx", "128", "--dtype", "float32"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if call(port, "/health", method="GET")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "error: interrupted"
    assert "authentication: none, any client that reaches the port may call /v1/" in err  # said at start
    with socket.create_server(("127.0.0.1", port)):  # the port is free again
        pass
    busy = socket.create_server(("127.0.0.1", 0))
    r = subprocess.run([sys.executable, "-m", "qlite", "serve", "-m", str(tiny_ckpt), "--port",
                        str(busy.getsockname()[1])], capture_output=True, text=True, env=env, timeout=60)
    busy.close()
    assert r.returncode == 1 and r.stderr.startswith("error: --host 127.0.0.1 --port") and "Traceback" not in r.stderr


def test_a_full_queue_answers_503(lm):
    from qlite.serve.engine import Job
    from qlite.generate import SamplingParams

    engine = Engine(lm, max_batch=1, ctx=64, max_queue=1)  # not started: nothing leaves the queue
    job = lambda: Job(lambda: [1, 2], SamplingParams(), emit=lambda ev: None)
    assert engine.submit(job()) and engine.submit(job())  # one for the free row, one waiting
    assert not engine.submit(job())


def test_soak_with_hostile_requests_on_a_tiny_model(tiny_ckpt):
    """The soak script (eval/benchmarks/serve_load.py) in small: 8 streaming clients, random lengths, clients that
    leave, 1 request in 10 hostile (every kind of eval.benchmarks.serve_load.HOSTILE at least once): every good
    answer complete and equal to its answer alone (float32: batching is exact there), every hostile
    request its JSON 4xx or a close, memory back to idle, no traceback in the server's log."""
    from eval.benchmarks.serve_load import HOSTILE

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-m", "eval.benchmarks.serve_load", "-m", str(tiny_ckpt), "--soak", "--requests", "200",
                        "--threads", "1", "--dtype", "float32"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    import re
    m = re.search(r"(\d+)/(\d+) good answered, (\d+)/\d+ as alone, (\d+)/(\d+) bad got their 4xx, (\d+) left.*"
                  r"RSS idle (\d+) MiB, after (\d+) MiB; active 0, waiting 0", r.stdout)
    assert m and m[1] == m[2] == m[3] and m[4] == m[5], r.stdout
    assert int(m[5]) >= len(HOSTILE), r.stdout  # each kind at least once
    assert int(m[8]) - int(m[7]) < 64, r.stdout  # flat: what requests used went back
    assert "Ctrl-C: exit status 130; server log: 0 tracebacks" in r.stdout


def test_load_script_reports_each_client_count_over_rounds(tiny_ckpt):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-m", "eval.benchmarks.serve_load", "-m", str(tiny_ckpt), "--clients", "1,2",
                        "--requests", "2", "--max-tokens", "4", "--rounds", "2", "--threads", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and rows[0].split("|")[5].strip().startswith("1.00x (1.00x-1.00x)"), r.stdout
    assert "2 round(s)" in r.stdout and "Ctrl-C: exit status 130" in r.stdout


def test_load_script_times_a_long_prompt_joining_against_a_second_server(tiny_ckpt):
    """--long-prompt adds a client sending a long prompt during the load (its time to first token
    reported, and the others' longest gap); --also runs a second server with other flags in turn."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-m", "eval.benchmarks.serve_load", "-m", str(tiny_ckpt), "--clients", "2",
                        "--requests", "2", "--max-tokens", "8", "--threads", "1", "--long-prompt", "10",
                        "--also", "--prefill-chunk 0"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith("| 2 |")]
    assert [row[7].strip() for row in rows] == ["plain", "--prefill-chunk 0"], r.stdout
    for row in rows:
        p50, p95, longest = (float(v) for v in row[9].split("/"))
        assert 0 <= p50 <= p95 <= longest and float(row[10]) > 0, r.stdout
    assert r.stdout.count("exit status 130") == 2


# Hostile requests: each fails alone, in OpenAI's JSON shape,
# while a well-formed stream beside it is answered exactly as alone.

def json_error(status_payload, status: int) -> dict:
    got, payload = status_payload
    assert got == status, payload
    return json.loads(payload)["error"]


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("raw, status, needle", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "lone surrogate"),
    (b'{"prompt": "a\\udfffb"}', 400, "lone surrogate"),
    (json.dumps({"messages": HI, "seed": 2 ** 64}).encode(), 400, "seed must be an integer from"),
    (json.dumps({"messages": HI, "seed": -2 ** 63 - 1}).encode(), 400, "seed must be"),
    (json.dumps({"messages": HI, "stream": "false"}).encode(), 400, "stream must be true or false"),
    (json.dumps({"messages": HI, "stream": True, "stream_options": [1]}).encode(), 400, "stream_options must be an object"),
    (json.dumps({"messages": HI, "stream": True, "stream_options": {"include_usage": "yes"}}).encode(), 400,
     "include_usage must be true or false"),
    (b"[" * 20000 + b"]" * 20000, 400, "nested too deeply"),
    (b" " * (LIMITS.max_body_bytes + 1), 413, "--max-body-bytes"),
    (json.dumps({"messages": HI, "model": ["tiny"]}).encode(), 400, "model must be a string"),  # was a 404
    (json.dumps({"messages": HI, "model": 7}).encode(), 400, "model must be a string"),
    (json.dumps({"messages": HI, "logit_bias": {"\uff10": 5}}).encode(), 400, "is not a token id"),  # was token 0
    (json.dumps({"prompt": "the", "logit_bias": {"\u0663": 5}}).encode(), 400, "is not a token id"),
])
def test_a_hostile_request_fails_alone_beside_a_stream(server, lm, raw, status, needle):
    port, engine = server
    want = lm.generate([{"role": "user", "content": "the"}], max_new_tokens=40)
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(chat, port, "the", max_tokens=40)
        time.sleep(0.05)
        path = "/v1/completions" if b'"prompt"' in raw else "/v1/chat/completions"
        error = json_error(call(port, path, raw=raw), status)
        assert good.result()["choices"][0]["message"]["content"] == want
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    assert engine.load()["active"] == 0


def test_a_tokenizer_id_past_the_vocabulary_fails_that_request_alone(server, lm, monkeypatch):
    port, _ = server
    encode = lm.tokenizer.encode
    monkeypatch.setattr(lm.tokenizer, "encode",
                        lambda text: [lm.model.config.vocab_size + 5] if "EVIL" in text else encode(text))
    error = json_error(call(port, "/v1/completions", {"prompt": "EVIL", "max_tokens": 4}), 400)
    assert "past the model's vocab_size" in error["message"] and error["param"] == "prompt"
    assert chat(port, "the", max_tokens=4)["choices"][0]["finish_reason"] in ("stop", "length")


def test_an_unexpected_failure_in_one_request_is_its_own_500(server, lm, monkeypatch):
    port, _ = server
    prompt_ids = lm.prompt_ids

    def broken(prompt, *args, **kwargs):
        if "BOOM" in str(prompt):
            raise RuntimeError("a bug in one request's preparation")
        return prompt_ids(prompt, *args, **kwargs)

    monkeypatch.setattr(lm, "prompt_ids", broken)
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(chat, port, "the", max_tokens=30)
        error = json_error(call(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "BOOM"}]}), 500)
        assert good.result()["choices"][0]["finish_reason"] in ("stop", "length")
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]


@pytest.mark.parametrize("method, path, status", [("POST", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405),
                                                  ("DELETE", "/health", 405)])
def test_every_status_is_json(server, method, path, status):
    port, _ = server
    error = json_error(call(port, path, {} if method == "POST" else None, method=method), status)
    assert error["message"]


def test_malformed_http_is_answered_in_the_json_error_shape(server):
    """uvicorn's own answer to a request it cannot parse was plain text."""
    port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GARBAGE \x00\x01 NOT HTTP\r\n\r\n")
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed HTTP request")


@pytest.mark.parametrize("origin", ["not a url", "https://app.example/path", "ftp://x.example", "https://", "*.example"])
def test_a_cors_origin_that_is_no_origin_is_refused(tiny_ckpt, capsys, origin):
    from cli_checks import assert_one_line_error, run_cli
    code, _, err = run_cli(capsys, "serve", "-m", tiny_ckpt, "--port", free_port(), "--cors", origin)
    assert_one_line_error(code, err, f"--cors {origin!r}: an origin is scheme://host[:port]")


def test_a_connection_that_sends_nothing_or_half_a_request_is_closed_after_the_timeout(server):
    port, _ = server
    for half in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(half)
            t0 = time.monotonic()
            assert s.recv(1) == b""  # closed by the server, nothing answered
            assert LIMITS.timeout_s - 0.5 < time.monotonic() - t0 < LIMITS.timeout_s + 20


def test_connections_past_the_cap_are_closed_and_the_server_goes_on(server):
    port, _ = server
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as extra:
            try:
                closed = extra.recv(1) == b""
            except ConnectionResetError:
                closed = True
            assert closed
    finally:
        for s in idle:
            s.close()
    deadline = time.time() + 10
    while time.time() < deadline:  # the idle ones' slots are free again
        try:
            if call(port, "/health", method="GET")[0] == 200:
                break
        except OSError:
            time.sleep(0.1)
    assert call(port, "/health", method="GET")[0] == 200


@pytest.mark.skipif(native.library() is None, reason="speculation needs the native kernels")
def test_a_speculating_server_answers_as_plain_decoding_with_usage_extras(tmp_path):
    """serve --speculate lookup on a bf16 model of native widths: the same text as the Python API,
    streamed and not; usage says what speculation did; "speculate": false opts a request out."""
    from qlite.speculate import Speculation
    lm = load(make_checkpoint(tmp_path / "bf16", **NATIVE_WIDTHS), dtype="bfloat16")
    prompt = "in the he in the he in the he in the"
    want = lm.generate(prompt, chat=False, max_new_tokens=24)
    engine = Engine(lm, max_batch=4, ctx=128, speculation=Speculation.named("lookup", lm.model)).start()
    with running(lm, engine) as (port, _):
        status, payload = call(port, "/v1/completions", {"prompt": prompt, "max_tokens": 24})
        assert status == 200, payload
        got = json.loads(payload)
        assert got["choices"][0]["text"] == want
        extras = got["usage"]["speculation"]
        assert extras["passes"] >= 1 and extras["accepted_tokens"] <= extras["proposed_tokens"]
        assert extras["tokens_per_pass"] == round(got["usage"]["completion_tokens"] / extras["passes"], 3)
        chunks = stream_pieces(port, "/v1/completions", {"prompt": prompt, "max_tokens": 24,
                                                          "stream_options": {"include_usage": True}})
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
        assert "speculation" in chunks[-1]["usage"]
        status, payload = call(port, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "speculate": False})
        assert json.loads(payload)["choices"][0]["text"] == want and "speculation" not in json.loads(payload)["usage"]
        status, payload = call(port, "/v1/completions", {"prompt": prompt, "speculate": "yes"})
        assert status == 400 and json.loads(payload)["error"]["param"] == "speculate"


def test_messages_as_clients_send_them(server, lm):
    """Content as a list of text parts, the developer role (a system message), a message's name: the
    same prompt as plain text content and a system message."""
    port, _ = server
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the\nhe"}]
    want = lm.generate(plain, max_new_tokens=8)
    status, payload = call(port, "/v1/chat/completions", {"max_tokens": 8, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "the"}, {"type": "text", "text": "he"}]}]})
    got = json.loads(payload)
    assert status == 200 and got["choices"][0]["message"]["content"] == want
    assert got["usage"]["prompt_tokens"] == len(lm.prompt_ids(plain))
    status, payload = call(port, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert status == 400 and "image_url part" in json.loads(payload)["error"]["message"]


def test_models_by_name_unknown_models_and_embeddings(server):
    port, _ = server
    status, payload = call(port, "/v1/models/tiny", method="GET")
    assert status == 200 and json.loads(payload)["id"] == "tiny"
    for status, payload in (call(port, "/v1/models/gpt-4o", method="GET"),
                            call(port, "/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user",
                                                                                                 "content": "hi"}]})):
        error = json.loads(payload)["error"]
        assert status == 404 and error["code"] == "model_not_found" and "gpt-4o" in error["message"], payload
    status, payload = call(port, "/v1/embeddings", {"input": "hi"})
    assert status == 404 and "embeddings" in json.loads(payload)["error"]["message"]
    status, payload = call(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 100000})
    assert status == 400 and json.loads(payload)["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("flag, env, where", [
    ((), "", "QLITE_API_KEY"), ((), "  ", "QLITE_API_KEY"), (("--api-key", ""), None, "--api-key"),
    (("--api-key", " "), "s3cret", "--api-key"),
])
def test_a_blank_api_key_is_refused_from_the_flag_and_the_environment(tiny_ckpt, capsys, monkeypatch, flag, env, where):
    """QLITE_API_KEY='' served with no authentication and said nothing (click reads an empty variable as
    unset); one rule for both now, before anything is loaded."""
    from cli_checks import assert_one_line_error, run_cli
    if env is None:
        monkeypatch.delenv("QLITE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("QLITE_API_KEY", env)
    code, _, err = run_cli(capsys, "serve", "-m", tiny_ckpt, "--port", free_port(), *flag)
    assert_one_line_error(code, err, f"{where}: empty")


def test_api_key_cors_and_aliases(lm):
    engine = Engine(lm, max_batch=2, ctx=64).start()
    with running(lm, engine, names=("tiny", "gpt-4o-mini"), api_key="s3cret", cors=("https://app.example",)) as (port, _):
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "the"}], "max_tokens": 4}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, payload = call(port, "/v1/chat/completions", body, headers=headers)
            error = json.loads(payload)["error"]
            assert status == 401 and error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
        status, payload, r = call(port, "/v1/chat/completions", body, response=True,
                                  headers={"Authorization": "Bearer s3cret", "Origin": "https://app.example"})
        assert status == 200 and json.loads(payload)["model"] == "tiny"
        assert r.getheader("access-control-allow-origin") == "https://app.example"
        status, _, r = call(port, "/v1/chat/completions", method="OPTIONS", response=True, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert status == 200 and r.getheader("access-control-allow-origin") == "https://app.example"
        status, _, r = call(port, "/health", method="GET", response=True, headers={"Origin": "https://evil.example"})
        assert status == 200 and r.getheader("access-control-allow-origin") is None  # open, but not to that page
        status, payload = call(port, "/v1/models", method="GET", headers={"Authorization": "Bearer s3cret"})
        assert [m["id"] for m in json.loads(payload)["data"]] == ["tiny", "gpt-4o-mini"]
