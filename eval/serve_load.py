"""Load on `qlite serve`: concurrent streaming clients, bounded in requests and time.

    python -m eval.serve_load -m DIR --clients 1,4,8,16 [--requests 16] [--max-tokens 64] [--rounds 3] [--markdown F]
    python -m eval.serve_load -m DIR --soak [--requests 200]

Starts the server (a subprocess, 2 threads unless --threads), waits for /health, then per client
count runs that many clients, each streaming chat completions of different prompts one after
another until --requests are done: aggregate decode rate = completion tokens / wall time. --rounds
repeats the client counts in turn (so drift in the machine's speed hits them alike) and reports the
median (min-max) rate and ratio to 1 client over the rounds. --soak:
8 clients, random max_tokens, some clients leaving mid-stream and some bad requests; checks every
good request is answered, every bad one gets its 400, and the server's memory returns to its idle
level; then Ctrl-C, which must exit 130.
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
    """One streaming request; returns completion tokens, time to first token, status."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"messages": [{"role": "user", "content": f"Write a short Python function for {content}."}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = {"status": r.status, "tokens": 0, "ttft": None, "done": False}
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
        if out["ttft"] is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
            out["ttft"] = time.perf_counter() - t0
        if event.get("usage"):
            out["tokens"] = event["usage"]["completion_tokens"]
        if leave_after is not None and events >= leave_after:
            conn.sock.shutdown(socket.SHUT_RDWR)
            out["left"] = True
            break
    conn.close()
    return out


def bad_request(port: int, kind: int) -> int:
    bodies = [b"{not json", json.dumps({"messages": "hi"}).encode(),
              json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(),
              json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode(),
              json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 7}).encode()]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", bodies[kind % len(bodies)], {"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


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
    plan = []
    for i in range(requests):
        roll = rng.random()
        plan.append(("bad", i) if roll < 0.1 else ("leave", rng.randint(1, 6)) if roll < 0.25 else
                    ("good", rng.randint(4, 96)))
    lock = threading.Lock()
    tally = {"good": 0, "good_answered": 0, "bad": 0, "bad_400": 0, "left": 0, "other": []}

    def client():
        while True:
            with lock:
                if not plan:
                    return
                kind, arg = plan.pop()
            if kind == "bad":
                status = bad_request(port, arg)
                with lock:
                    tally["bad"] += 1
                    tally["bad_400"] += status == 400
            elif kind == "leave":
                stream_chat(port, rng.choice(TOPICS), 64, leave_after=arg)
                with lock:
                    tally["left"] += 1
            else:
                r = stream_chat(port, rng.choice(TOPICS), arg)
                with lock:
                    tally["good"] += 1
                    tally["good_answered"] += r["status"] == 200 and r["done"] and r["tokens"] >= 1
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
@click.option("--markdown", "md_path", type=click.Path(path_type=Path))
def main(model_dir, clients, requests, max_tokens, max_batch, threads, time_limit, rounds, soak_mode, md_path):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "qlite", "serve", "-m", str(model_dir), "--port", str(port),
                               "--max-batch", str(max_batch), "--threads", str(threads), "--ctx", "2048"])
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
                         f"{tally['good_answered']}/{tally['good']} good answered, {tally['bad_400']}/{tally['bad']} "
                         f"bad got 400, {tally['left']} left mid-stream; server RSS idle {idle:.0f} MiB, after "
                         f"{after:.0f} MiB; active {state['active']}, waiting {state['waiting']}")
            if tally["other"]:
                lines.append(f"unanswered: {tally['other'][:3]}")
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
        lines.append(f"Ctrl-C: exit status {rc}")
    finally:
        if server.poll() is None:
            server.kill()
    text = "\n".join(lines)
    click.echo(text)
    if md_path:
        md_path.write_text(text + "\n")


if __name__ == "__main__":
    main()
