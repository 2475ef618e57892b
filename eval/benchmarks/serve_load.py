"""Load on `qlite serve`: concurrent streaming clients, bounded in requests and time.

    python -m eval.benchmarks.serve_load -m DIR --clients 1,4,8,16 [--requests 16] [--max-tokens 64] [--rounds 3] [--markdown F]
        [--speculate lookup|DRAFT_DIR] [--prompts asks|code-edit] [--long-prompt TOKENS] [--also 'SERVE FLAGS']
    python -m eval.benchmarks.serve_load -m DIR --soak [--requests 200]

Starts the server (a subprocess, 2 threads unless --threads), waits for /health, then per client
count runs that many clients, each streaming chat completions of different prompts one after
another until --requests are done: aggregate decode rate = completion tokens / wall time. --rounds
repeats the client counts in turn (so drift in the machine's speed hits them alike) and reports the
median (min-max) rate and ratio to 1 client over the rounds. --speculate: a second server with
`qlite serve --speculate`, loaded beside the first and run in turn with it (the same client counts
each round), its rate also as a ratio to the plain server's; --also FLAGS likewise, a server with those
`qlite serve` flags. --long-prompt N: while the clients run, one more client keeps sending a prompt of
about N tokens (code to summarize, 8 tokens of answer; each one numbered, so the prompt cache cannot serve it): its time to first token is reported, and the
others' longest gap between two tokens (the stall a long prompt's prefill puts on running streams:
qlite serve --prefill-chunk). --soak:
8 clients, random max_tokens, some clients leaving mid-stream and 1 request in 10 hostile (HOSTILE:
malformed JSON and fields, a lone surrogate, an out-of-range seed, deep JSON, an oversized body,
unknown routes, a connection that sends nothing or half a request); checks every good request is
answered exactly as it is alone (greedy), every hostile one gets its JSON 4xx (or, sending nothing,
is closed), the server's memory returns to its idle level and its log holds no traceback; then
Ctrl-C, which must exit 130.
"""
from __future__ import annotations

import http.client
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

TOPICS = ["a prime test", "binary search", "a stack class", "reversing a string", "fizzbuzz", "a linked list",
          "merging two sorted lists", "counting words", "a palindrome check", "factorial", "gcd", "a queue class",
          "flattening a list", "a matrix product", "the median of a list", "run-length encoding"]
ASKS = [f"Write a short Python function for {topic}." for topic in TOPICS]


FOLLOW_UPS = ["Now add type hints.", "Now add a docstring.", "Now write one test for it."]


def prompt_set(name: str) -> list:
    """The prompts of a load: asks (a short function per topic: open generation), chat (each ask
    followed by FOLLOW_UPS, the history re-sent every turn) or code-edit (eval.benchmarks.speculation's: code to
    return with a change, where prompt lookup proposes well)."""
    if name == "asks":
        return ASKS
    if name == "chat":
        return [[ask, *FOLLOW_UPS] for ask in ASKS]
    from eval.benchmarks.speculation import prompt_sets
    return prompt_sets([name], None)[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def stream_chat(port: int, content: str | list[dict], max_tokens: int, leave_after: int | None = None) -> dict:
    """One greedy streaming request (a user message, or a whole conversation); returns completion tokens,
    time to first token, the gaps between content chunks, status, text."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"messages": [{"role": "user", "content": content}] if isinstance(content, str) else content,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = {"status": r.status, "tokens": 0, "ttft": None, "done": False, "text": "", "gaps": []}
    last = None
    if r.status != 200:
        r.read()
        conn.close()
        return out
    events = 0
    while True:
        line = r.fp.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            out["done"] = True
            break
        event = json.loads(data)
        events += 1
        if event.get("choices") and event["choices"][0]["delta"].get("content"):
            now = time.perf_counter()
            out["ttft"] = out["ttft"] or now - t0
            if last is not None:
                out["gaps"].append(now - last)
            last = now
            out["text"] += event["choices"][0]["delta"]["content"]
        if event.get("usage"):
            out["tokens"] = event["usage"]["completion_tokens"]
        if leave_after is not None and events >= leave_after:
            conn.sock.shutdown(socket.SHUT_RDWR)
            out["left"] = True
            break
    conn.close()
    return out


HI = [{"role": "user", "content": "hi"}]
HOSTILE = [  # (name, request bytes after the request line's path, what must come back)
    ("not json", b"{not json", 400), ("messages not a list", {"messages": "hi"}, 400),
    ("temperature -1", {"messages": HI, "temperature": -1}, 400),
    ("unknown model", {"model": "nope", "messages": HI}, 404),
    ("max_tokens past the context", {"messages": HI, "max_tokens": 10 ** 7}, 400),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400),
    ("seed 2**64", {"messages": HI, "seed": 2 ** 64}, 400),
    ("seed below -2**63", {"messages": HI, "seed": -2 ** 63 - 1}, 400),
    ("stream 'false'", {"messages": HI, "stream": "false"}, 400),
    ("stream_options a list", {"messages": HI, "stream": True, "stream_options": [1]}, 400),
    ("deep JSON", b"[" * 100000 + b"]" * 100000, 400), ("body past the limit", b" " * (9 * 2 ** 20), 413),
    ("unknown route", ("POST", "/v1/nothing", b"{}"), 404), ("wrong method", ("GET", "/v1/chat/completions", b""), 405),
    ("a connection that sends nothing", "idle", None), ("half a request", "half", None),
]


def hostile_request(port: int, kind: int) -> bool:
    """One hostile request of HOSTILE; whether it got what it must (its JSON error, or a close)."""
    name, body, expect = HOSTILE[kind % len(HOSTILE)]
    if body in ("idle", "half"):
        with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
            if body == "half":
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            try:
                return s.recv(1) == b""  # closed by the server's timeout, nothing sent
            except (ConnectionResetError, socket.timeout):
                return False
    method, path, data = body if isinstance(body, tuple) else ("POST", "/v1/chat/completions", body)
    data = data if isinstance(data, bytes) else json.dumps(data).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        payload = r.read()
    except (ConnectionResetError, BrokenPipeError):  # a server may close on an oversized body as it refuses it
        return expect == 413
    finally:
        conn.close()
    try:
        return r.status == expect and bool(json.loads(payload)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return False


def long_prompt_text(tokens: int) -> str:
    """About `tokens` tokens of code (eval.benchmarks.speculation's code-edit sources, repeated) to summarize."""
    from eval.benchmarks.speculation import prompt_sets
    code = "\n\n".join(prompt_sets(["code-edit"], None)["code-edit"])
    text = (code * (1 + 4 * tokens // len(code)))[:int(3.6 * tokens)]  # ~3.6 characters a token (the demo's tokenizer)
    return f"Summarize what this code does in one sentence.\n\n{text}"


def numbered(i: int, text: str) -> str:  # a different start every time: nothing for the prompt cache to reuse
    return f"Request {i}. {text}"


def run_clients(port: int, clients: int, requests: int, max_tokens: int, deadline: float,
                prompts: list = ASKS, long_prompt: str | None = None) -> dict:
    """`clients` threads take the prompts in turn until `requests` are answered. A prompt is a user
    message, or a conversation's user turns (a list): each turn a request that re-sends the history
    with the answers so far, as chat front-ends do. long_prompt: one more thread sends it again and
    again while they run."""
    todo = list(range(requests))
    lock = threading.Lock()
    results, long_results, running = [], [], threading.Event()

    def joiner():  # at least once
        while not long_results or running.is_set():
            long_results.append(stream_chat(port, numbered(len(long_results), long_prompt), 8))

    def client():
        while time.time() < deadline:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            prompt = prompts[i % len(prompts)]
            if isinstance(prompt, str):
                results.append(stream_chat(port, prompt, max_tokens))
                continue
            history = []
            for turn in prompt:
                history.append({"role": "user", "content": turn})
                results.append(stream_chat(port, history, max_tokens))
                history.append({"role": "assistant", "content": results[-1]["text"]})

    t0 = time.perf_counter()
    running.set()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    extra = threading.Thread(target=joiner)
    if long_prompt:
        time.sleep(0.5)  # the streams first
        extra.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    running.clear()
    if long_prompt:
        extra.join()
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = sorted(g for r in results for g in r["gaps"])
    return {"clients": clients, "requests": len(results), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "itl_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else None,
            "itl_p95_ms": 1000 * gaps[int(len(gaps) * 0.95)] if gaps else None,
            "itl_max_ms": 1000 * gaps[-1] if gaps else None,
            "long_ttft_s": statistics.median(r["ttft"] for r in long_results if r["ttft"] is not None)
            if any(r["ttft"] is not None for r in long_results) else None,
            "all_done": all(r["done"] for r in results + long_results)}


def soak(port: int, pid: int, requests: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    plan, hostile = [], 0
    for i in range(requests):
        roll = rng.random()
        hostile += roll < 0.1  # the hostile kinds in turn
        plan.append(("bad", hostile - 1) if roll < 0.1 else ("leave", rng.randint(1, 6)) if roll < 0.25 else
                    ("good", (rng.choice(ASKS), rng.randint(4, 96))))
    alone = {arg: stream_chat(port, *arg)["text"] for kind, arg in plan if kind == "good"}  # one at a time
    lock = threading.Lock()
    tally = {"good": 0, "good_answered": 0, "good_exact": 0, "bad": 0, "bad_400": 0, "left": 0, "other": [],
             "bad_missed": []}

    def client():
        while True:
            with lock:
                if not plan:
                    return
                kind, arg = plan.pop()
            if kind == "bad":
                ok = hostile_request(port, arg)
                with lock:
                    tally["bad"] += 1
                    tally["bad_400"] += ok
                    if not ok:
                        tally["bad_missed"].append(HOSTILE[arg % len(HOSTILE)][0])
            elif kind == "leave":
                stream_chat(port, rng.choice(ASKS), 64, leave_after=arg)
                with lock:
                    tally["left"] += 1
            else:
                r = stream_chat(port, *arg)
                with lock:
                    tally["good"] += 1
                    tally["good_answered"] += r["status"] == 200 and r["done"] and r["tokens"] >= 1
                    tally["good_exact"] += r["text"] == alone[arg]
                    if not (r["status"] == 200 and r["done"]):
                        tally["other"].append(r)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally


def health(port: int) -> dict:
    """/health's answer; OSError until the server answers 200 (llama-server: 503 while it loads)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    if r.status != 200:
        raise OSError(f"/health: {r.status}")
    return body


@click.command()
@click.option("--model", "-m", "model_dir", required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--clients", default="1,4,8,16", show_default=True)
@click.option("--requests", default=16, show_default=True, help="requests per client count (soak: in all)")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--max-batch", default=16, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--time-limit", default=600.0, show_default=True, help="seconds per client count")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1, 10))
@click.option("--soak", "soak_mode", is_flag=True)
@click.option("--dtype", default="auto", show_default=True, help="the server's --dtype")
@click.option("--markdown", "md_path", type=click.Path(path_type=Path))
@click.option("--speculate", help="also a server with --speculate this, run in turn with the plain one")
@click.option("--also", "also_flags", help="also a server with these qlite serve flags (one string), run in turn")
@click.option("--long-prompt", type=click.IntRange(1, 100_000),
              help="one more client sending a prompt of about this many tokens while the others run")
@click.option("--prompts", type=click.Choice(["asks", "chat", "code-edit"]), default="asks", show_default=True,
              help="the user messages: a short function per topic, multi-turn chats on them (a request per "
                   "turn), or eval.benchmarks.speculation's code edits")
@click.option("--llama-server", "llama_server", type=click.Path(exists=True, path_type=Path),
              help="llama.cpp's llama-server binary: also run the load against it (with --gguf), -np max-batch -cb")
@click.option("--gguf", type=click.Path(exists=True, path_type=Path), help="the GGUF llama-server serves")
def main(model_dir, clients, requests, max_tokens, max_batch, threads, time_limit, rounds, soak_mode, dtype, md_path,
         speculate, also_flags, long_prompt, prompts, llama_server, gguf):
    if soak_mode and (speculate or llama_server or also_flags or long_prompt):
        raise click.UsageError("--soak runs one server: drop --speculate, --also, --long-prompt and --llama-server")
    if bool(llama_server) != bool(gguf):
        raise click.UsageError("--llama-server and --gguf go together")
    # the soak checks answers bit for bit against each alone: the prompt cache and chunked prefill, which
    # can move a logit's last bits (prompt_cache.py, engine.py) as timing decides, are off for it
    servers = [start_server(model_dir, max_batch, threads, dtype,
                            ["--prompt-cache-mib", "0", "--prefill-chunk", "0"] if soak_mode else [], "plain")]
    if also_flags:
        servers.append(start_server(model_dir, max_batch, threads, dtype, also_flags.split(), also_flags))
    if speculate:
        servers.append(start_server(model_dir, max_batch, threads, dtype, ["--speculate", speculate],
                                    f"--speculate {speculate}"))
    if llama_server:
        servers.append(start_server(None, max_batch, threads, dtype, [], "llama-server", peer=(llama_server, gguf)))
    try:
        lines = loads(servers, clients, requests, max_tokens, time_limit, rounds, soak_mode, prompt_set(prompts),
                      long_prompt_text(long_prompt) if long_prompt else None)
        for server, log, _, name in servers:
            server.send_signal(signal.SIGINT)
            rc = server.wait(120)
            log.seek(0)
            lines.append(f"Ctrl-C{f' ({name})' if len(servers) > 1 else ''}: exit status {rc}; server log: "
                         f"{log.read().count('Traceback')} tracebacks")
    finally:
        for server, *_ in servers:
            if server.poll() is None:
                server.kill()
    text = "\n".join(lines)
    click.echo(text)
    if md_path:
        md_path.write_text(text + "\n")


def start_server(model_dir, max_batch: int, threads: int, dtype: str, extra: list[str], name: str,
                 peer: tuple | None = None) -> tuple:
    """(process, its log, port, name) of a `qlite serve` (or, peer = (llama-server, gguf), of llama.cpp's
    server with as many slots and the same context per slot, continuous batching on) that answers
    /health and has decoded a first batch."""
    port, log = free_port(), tempfile.TemporaryFile(mode="w+")
    command = [sys.executable, "-m", "qlite", "serve", "-m", str(model_dir), "--port", str(port), "--max-batch",
               str(max_batch), "--threads", str(threads), "--ctx", "2048", "--timeout", "3", "--dtype", dtype, *extra]
    if peer:
        command = [str(peer[0]), "-m", str(peer[1]), "--port", str(port), "-np", str(max_batch), "-cb", "-t",
                   str(threads), "-c", str(2048 * max_batch)]
    server = subprocess.Popen(command, stderr=log, stdout=log)
    deadline = time.time() + 300
    while True:
        try:
            health(port)
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                log.seek(0)
                raise SystemExit(f"the server did not start: {log.read()[-500:]}")
            time.sleep(0.5)
    warm = [threading.Thread(target=stream_chat, args=(port, t, 16)) for t in ASKS[:8]]
    for t in warm:  # a first batch: torch's one-time allocations for batched steps happen here
        t.start()
    for t in warm:
        t.join()
    return server, log, port, name


def loads(servers: list[tuple], clients: str, requests: int, max_tokens: int, time_limit: float, rounds: int,
          soak_mode: bool, prompts: list[str], long_prompt: str | None = None) -> list[str]:
    time.sleep(1.0)
    idle = [rss_mib(server.pid) for server, *_ in servers]
    if soak_mode:
        server, _, port, _ = servers[0]
        t0 = time.perf_counter()
        tally = soak(port, server.pid, requests)
        time.sleep(2.0)  # the engine gives freed memory back once idle for IDLE_RELEASE_S
        after = rss_mib(server.pid)
        state = health(port)
        lines = [f"soak: {requests} requests from 8 clients in {time.perf_counter() - t0:.0f} s: "
                 f"{tally['good_answered']}/{tally['good']} good answered, {tally['good_exact']}/{tally['good']} "
                 f"as alone, {tally['bad_400']}/{tally['bad']} bad got their 4xx, {tally['left']} left "
                 f"mid-stream; server RSS idle {idle[0]:.0f} MiB, after {after:.0f} MiB; active {state['active']}, "
                 f"waiting {state['waiting']}"]
        if tally["other"]:
            lines.append(f"unanswered: {tally['other'][:3]}")
        if tally["bad_missed"]:
            lines.append(f"hostile requests not refused as they must be: {sorted(set(tally['bad_missed']))}")
        return lines
    counts = [int(c) for c in clients.split(",")]
    runs = [[[run_clients(port, c, requests, max_tokens, time.time() + time_limit, prompts, long_prompt) for c in counts]
             for _, _, port, _ in servers] for _ in range(rounds)]  # runs[round][server][count]

    def spread(values, fmt):
        text = fmt.format(statistics.median(values))
        return text if len(values) == 1 else f"{text} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    lines = [f"{rounds} round(s); median (min-max) over the rounds",
             "| clients | requests | completion tokens | aggregate tokens/s | vs 1 client | "
             "median time to first token (s) | server | vs qlite plain | inter-token p50 / p95 / max (ms) |"
             + (" long prompt's time to first token (s) |" if long_prompt else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if long_prompt else "")]
    for i, c in enumerate(counts):
        for j, (_, _, _, name) in enumerate(servers):
            rates = [run[j][i]["tokens_per_s"] for run in runs]
            ratios = [run[j][i]["tokens_per_s"] / run[j][0]["tokens_per_s"] for run in runs]
            vs_plain = [run[j][i]["tokens_per_s"] / run[0][i]["tokens_per_s"] for run in runs]

            def med(key):
                return statistics.median(run[j][i][key] or float("nan") for run in runs)
            lines.append(f"| {c} | {runs[0][j][i]['requests']} | {runs[0][j][i]['tokens']} | {spread(rates, '{:.1f}')} | "
                         f"{spread(ratios, '{:.2f}x')} | {med('ttft_median_s'):.2f} | {name} | "
                         f"{spread(vs_plain, '{:.2f}x')} | {med('itl_p50_ms'):.0f} / {med('itl_p95_ms'):.0f} / "
                         f"{med('itl_max_ms'):.0f} |" + (f" {med('long_ttft_s'):.2f} |" if long_prompt else ""))
    lines.append("")
    unfinished = sum(not r["all_done"] for run in runs for server_runs in run for r in server_runs)
    if unfinished:
        lines.append(f"{unfinished} load(s) had requests that did not finish (an error status or a cut stream)")
    lines += [f"server RSS ({name}) idle {before:.0f} MiB, after the runs {rss_mib(server.pid):.0f} MiB"
              for (server, _, _, name), before in zip(servers, idle)]
    return lines

if __name__ == "__main__":
    main()
