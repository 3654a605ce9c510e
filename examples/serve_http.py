"""Chat requests over HTTP to `hf-domino serve`, with the drafter and without (`--no-drafter`, the target alone on the
same server): each request's latency and the tokens per second, one request at a time (the server's `generate()`
path) or, with `--continuous-batching`, all sent at once (the server's continuous-batching manager).

Each way runs as a server process of its own, one at a time, in an order that alternates between repeats, each after
a warm-up request. Greedy (temperature 0), fp32 on a CPU with its fast path (both ways). One at a time, every answer
with the drafter is asserted identical to the target alone's; continuously batched, the target alone is transformers'
manager, whose paged attention rounds otherwise, and the count of identical answers is printed. docs/benchmarks.md
quotes it:

    python examples/serve_http.py --prompts mtbench --num-prompts 8 --max-tokens 64 --repeats 2
    python examples/serve_http.py --prompts mtbench --num-prompts 8 --max-tokens 64 --repeats 2 \
        --continuous-batching --max-requests-per-batch 4
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from hf_domino.prompt_sets import load_prompts

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WAYS = {"target alone": ["--no-drafter"], "drafter": []}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def start_server(options: list[str], continuous_batching: bool) -> tuple[subprocess.Popen, int]:
    """`hf-domino serve` on a free port, once it answers."""
    port = free_port()
    command = [sys.executable, "-m", "hf_domino", "serve", "--port", str(port), *options]
    server = subprocess.Popen(command + (["--continuous-batching"] if continuous_batching else []),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    while True:
        try:
            urllib.request.urlopen(f"http://localhost:{port}/health", timeout=5)
            return server, port
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"`{' '.join(command)}` exited with status {server.returncode}") from None
            time.sleep(0.5)


def ask(port: int, messages: list[dict], max_tokens: int) -> tuple[str, int, float]:
    """One greedy chat completion: its text, its tokens and the seconds it took."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"http://localhost:{port}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=1800) as response:
        answer = json.loads(response.read())
    return (
        answer["choices"][0]["message"]["content"],
        answer["usage"]["completion_tokens"],
        time.perf_counter() - start,
    )


def run_way(options, prompts, max_tokens, continuous_batching) -> tuple[list[tuple[str, int, float]], float]:
    """Every prompt through one server: each answer, and the wall seconds from the first request to the last answer
    (one at a time, or all at once with continuous batching)."""
    server, port = start_server(options, continuous_batching)
    try:
        ask(port, prompts[0], 8)  # warm-up: first-call set-up, the policy's cost table
        start = time.perf_counter()
        if continuous_batching:
            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(lambda messages: ask(port, messages, max_tokens), prompts))
        else:
            answers = [ask(port, messages, max_tokens) for messages in prompts]
        return answers, time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--continuous-batching", action="store_true")
    parser.add_argument(
        "--max-requests-per-batch", type=int, default=None, help="with --continuous-batching: rows, both servers"
    )
    args = parser.parse_args()
    rows = ["--max-requests-per-batch", str(args.max_requests_per_batch)] if args.max_requests_per_batch else []
    prompts = [messages[:1] for messages in load_prompts(args.prompts, args.num_prompts)]  # first turns
    latencies = {way: [] for way in WAYS}  # per way, per repeat: each request's seconds
    walls = {way: [] for way in WAYS}
    texts, tokens = {}, {}
    for repeat in range(args.repeats):
        for way in list(WAYS)[:: 1 if repeat % 2 == 0 else -1]:
            answers, wall = run_way(WAYS[way] + rows, prompts, args.max_tokens, args.continuous_batching)
            texts.setdefault(way, [text for text, _, _ in answers])
            tokens[way] = sum(count for _, count, _ in answers)
            latencies[way].append([seconds for _, _, seconds in answers])
            walls[way].append(wall)
            print(f"repeat {repeat}, {way}: {wall:.1f} s, {tokens[way]} tokens", flush=True)
    same = sum(a == b for a, b in zip(texts["drafter"], texts["target alone"]))
    if not args.continuous_batching:
        assert same == len(prompts), "an answer with the drafter differs from the target alone's"
    mode = "all at once, continuous batching" if args.continuous_batching else "one at a time"
    if rows:
        mode += f", {args.max_requests_per_batch} rows at a time"
    # transformers' manager reads the target through its paged attention, which rounds otherwise than `generate()`.
    print(
        f"\n{len(prompts)} {args.prompts} prompts, {args.max_tokens} tokens at most, {mode}; {same} answers identical"
    )
    print("| way | median latency | wall (median of repeats) | tokens/s | against the target alone |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(walls["target alone"])
    for way in WAYS:
        # Per request, the median over repeats; then the median over requests.
        latency = statistics.median(statistics.median(run[i] for run in latencies[way]) for i in range(len(prompts)))
        wall = statistics.median(walls[way])
        print(f"| {way} | {latency:.2f} s | {wall:.1f} s | {tokens[way] / wall:.1f} | {base / wall:.2f}x |")


if __name__ == "__main__":
    main()
