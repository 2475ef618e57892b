"""Load on `qlite serve`: concurrent streaming clients, bounded in requests and time.

    python -m eval.serve_load -m DIR --clients 1,4,8,16 [--requests 16] [--max-tokens 64] [--rounds 3] [--markdown F]
    python -m eval.serve_load -m DIR --soak [--requests 200]

Starts the server (a subprocess, 2 threads unless --threads), waits for /health, then per client
count runs that many clients, each streaming chat completions of different prompts one after
another until --requests are done: aggregate decode rate = completion tokens / wall time. --rounds
repeats the client counts in turn (so drift in the machine's speed hits them alike) and reports the
median (min-max) rate and ratio to 1 client over the rounds. --soak:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def stream_chat(port: int, content: str, max_tokens: int, leave_after: int | None = None) -> dict:
    """One greedy streaming request; returns completion tokens, time to first token, status, text."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"messages": [{"role": "user", "content": f"Write a short Python function for {content}."}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = {"status": r.status, "tokens": 0, "ttft": None, "done": False, "text": ""}
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
            out["ttft"] = out["ttft"] or time.perf_counter() - t0
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
    ("unknown model", {"model": "nope", "messages": HI}, 400),
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


def run_clients(port: int, clients: int, requests: int, max_tokens: int, deadline: float) -> dict:
    todo = list(range(requests))
    lock = threading.Lock()
    results = []

    def client():
        while time.time() < deadline:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            results.append(stream_chat(port, TOPICS[i % len(TOPICS)], max_tokens))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"clients": clients, "requests": len(results), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "all_done": all(r["done"] for r in results)}


def soak(port: int, pid: int, requests: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    plan, hostile = [], 0
    for i in range(requests):
        roll = rng.random()
        hostile += roll < 0.1  # the hostile kinds in turn
        plan.append(("bad", hostile - 1) if roll < 0.1 else ("leave", rng.randint(1, 6)) if roll < 0.25 else
                    ("good", (rng.choice(TOPICS), rng.randint(4, 96))))
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
                stream_chat(port, rng.choice(TOPICS), 64, leave_after=arg)
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
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    body = json.loads(conn.getresponse().read())
    conn.close()
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
def main(model_dir, clients, requests, max_tokens, max_batch, threads, time_limit, rounds, soak_mode, dtype, md_path):
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen([sys.executable, "-m", "qlite", "serve", "-m", str(model_dir), "--port", str(port),
                               "--max-batch", str(max_batch), "--threads", str(threads), "--ctx", "2048",
                               "--timeout", "3", "--dtype", dtype], stderr=log)
    try:
        deadline = time.time() + 300
        while True:
            try:
                health(port)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(0.5)
        warm = [threading.Thread(target=stream_chat, args=(port, t, 16)) for t in TOPICS[:8]]
        for t in warm:  # a first batch: torch's one-time allocations for batched steps happen here
            t.start()
        for t in warm:
            t.join()
        time.sleep(1.0)
        idle = rss_mib(server.pid)
        lines = []
        if soak_mode:
            t0 = time.perf_counter()
            tally = soak(port, server.pid, requests)
            time.sleep(1.0)
            after = rss_mib(server.pid)
            state = health(port)
            lines.append(f"soak: {requests} requests from 8 clients in {time.perf_counter() - t0:.0f} s: "
                         f"{tally['good_answered']}/{tally['good']} good answered, {tally['good_exact']}/{tally['good']} "
                         f"as alone, {tally['bad_400']}/{tally['bad']} bad got their 4xx, {tally['left']} left "
                         f"mid-stream; server RSS idle {idle:.0f} MiB, after {after:.0f} MiB; active {state['active']}, "
                         f"waiting {state['waiting']}")
            if tally["other"]:
                lines.append(f"unanswered: {tally['other'][:3]}")
            if tally["bad_missed"]:
                lines.append(f"hostile requests not refused as they must be: {sorted(set(tally['bad_missed']))}")
        else:
            counts = [int(c) for c in clients.split(",")]
            runs = [[run_clients(port, c, requests, max_tokens, time.time() + time_limit) for c in counts]
                    for _ in range(rounds)]  # runs[round][count]

            def spread(values, fmt):
                text = fmt.format(statistics.median(values))
                return text if len(values) == 1 else f"{text} ({fmt.format(min(values))}-{fmt.format(max(values))})"

            lines += [f"{rounds} round(s); median (min-max) over the rounds",
                      "| clients | requests | completion tokens | aggregate tokens/s | vs 1 client | "
                      "median time to first token (s) |", "|---|---|---|---|---|---|"]
            for i, c in enumerate(counts):
                rates = [run[i]["tokens_per_s"] for run in runs]
                ratios = [run[i]["tokens_per_s"] / run[0]["tokens_per_s"] for run in runs]
                ttft = statistics.median(run[i]["ttft_median_s"] or float("nan") for run in runs)
                lines.append(f"| {c} | {runs[0][i]['requests']} | {runs[0][i]['tokens']} | {spread(rates, '{:.1f}')} | "
                             f"{spread(ratios, '{:.2f}x')} | {ttft:.2f} |")
            lines.append(f"\nserver RSS idle {idle:.0f} MiB, after the runs {rss_mib(server.pid):.0f} MiB")
        server.send_signal(signal.SIGINT)
        rc = server.wait(120)
        log.seek(0)
        lines.append(f"Ctrl-C: exit status {rc}; server log: {log.read().count('Traceback')} tracebacks")
    finally:
        if server.poll() is None:
            server.kill()
    text = "\n".join(lines)
    click.echo(text)
    if md_path:
        md_path.write_text(text + "\n")


if __name__ == "__main__":
    main()
