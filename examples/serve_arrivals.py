"""Requests that arrive over time, served by a manager (`init_continuous_batching`): the drafted batch's manager
(`assistant_model=drafter`) against transformers' own manager of the target alone, and against the drafted manager
taking plain steps only (the same loop, no drafter and no copies), on the SmolLM2 target and the shipped drafter (on
a CPU, its fast path).

On a CPU, torch's work in a manager's thread is slower while the caller's OpenMP workers run (docs/benchmarks.md, "On
a CPU, torch's work in a second thread"). The drafted manager's `start()` releases them; transformers' manager runs
twice, once with the caller's workers running (after parallel work of the caller's, as a user's process has them) and
once with them released first (`hf_domino.release_openmp_workers()`, what docs/usage.md tells its users to call).
`--show-calls` prints what the drafted managers' judge read of each window of cycles (`judge_call`): its gain over
plain steps counting when each request came, and as if every request had come at the window's start.

A client thread adds the prompts at Poisson arrival times (`--rate` requests per second, seeded, the same times for
every method) with `streaming=True`, and reads every result as it comes. Per method: tokens per second over the run
(first arrival to last result), and the median and 90th percentile of each request's latency (arrival to its last
token) and of its time to first token. Every answer is asserted identical to the target alone's on a CPU (counted on
a GPU). docs/benchmarks.md quotes it:

    python examples/serve_arrivals.py --prompts mtbench --num-prompts 32 --rate 1.5 --rows 4
    python examples/serve_arrivals.py --prompts humaneval --num-prompts 32 --rate 0.25 --rows 4 --show-calls
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch
from transformers import GenerationConfig

from hf_domino import batch_policy_domino, prepare_for_cpu_decoding, release_openmp_workers
from hf_domino.assets import chat_token_ids, load_drafter, load_target
from hf_domino.measure_batch import paged_cache_for
from hf_domino.prompt_sets import load_prompts


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives: exponential gaps at `rate` per second."""
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def serve(manager, prompts: list[list[int]], arrivals: list[float]) -> dict:
    """Adds each prompt at its arrival time from a client thread, reads results until all finished; per request its
    tokens, its latency and its time to first token, and the run's seconds."""
    added, first, done = {}, {}, {}

    def client() -> None:
        start = time.perf_counter()
        for index, (prompt, at) in enumerate(zip(prompts, arrivals)):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            added[f"r{index}"] = time.perf_counter()
            manager.add_request(prompt, request_id=f"r{index}", streaming=True)

    thread = threading.Thread(target=client)
    start = time.perf_counter()
    thread.start()
    while len(done) < len(prompts):
        result = manager.get_result(timeout=600)
        assert result is not None, "the manager stopped before every request finished"
        now = time.perf_counter()
        first.setdefault(result.request_id, now)
        if result.is_finished():
            assert result.error is None, result.error
            done[result.request_id] = (result.generated_tokens, now)
    thread.join()
    names = [f"r{index}" for index in range(len(prompts))]
    return {
        "answers": [done[name][0] for name in names],
        "latency": [done[name][1] - added[name] for name in names],
        "first": [first[name] - added[name] for name in names],
        "seconds": max(finished for _, finished in done.values()) - start,
    }


def keep_workers() -> None:
    """Parallel work in this thread, so that its OpenMP workers run (as after any torch work of the caller's)."""
    torch.ones(1 << 22).sum()


def shown(call_gain):
    """`call_gain` as the judge of a window of cycles reads it (`judge_call`), printing it with its requests' arrivals
    and as if every request had come at the window's start."""

    def shown_call_gain(policy, cycle_times, steps, limit=None, arrivals=None) -> float:
        gain = call_gain(policy, cycle_times, steps, limit, arrivals)
        late = sum(at > 0 for at in arrivals or [])
        print(f"    judged {sum(count > 0 for count in steps)} requests ({late} came while they ran): gain {gain:.2f} "
              f"counting arrivals, {call_gain(policy, cycle_times, steps, limit):.2f} as if all came at its start",
              flush=True)  # fmt: skip
        return gain

    return shown_call_gain


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--show-calls", action="store_true", help="print what the judge read of each window")
    parser.add_argument("--methods", default="kept,released,plain,drafter",
                        help="which to run, of kept,released (transformers' manager),plain,drafter (the drafter's)")  # fmt: skip
    args = parser.parse_args()
    if args.show_calls:
        batch_policy_domino.call_gain = shown(batch_policy_domino.call_gain)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device=args.device)
    drafter = load_drafter(None).to(target.device, target.dtype)
    print(prepare_for_cpu_decoding(target, drafter, batch_size=args.rows))
    prompts = [chat_token_ids(tokenizer, messages) for messages in load_prompts(args.prompts, args.num_prompts)]
    new = args.max_new_tokens
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=target.generation_config.eos_token_id)
    pages = paged_cache_for(prompts, args.rows, new)
    drafted = dict(assistant_model=drafter)
    methods = {  # --methods key: (its name, the manager's options, whether the caller's OpenMP workers are released)
        "kept": ("target, transformers' manager", {}, False),
        "released": ("target, transformers' manager, released", {}, True),
        "plain": (
            "drafter's manager, plain steps only",
            dict(drafted, num_speculative_tokens=0, domino_lookup=False),
            True,
        ),
        "drafter": ("drafter's manager", drafted, True),
    }
    chosen = args.methods.split(",")
    if unknown := set(chosen) - set(methods):
        parser.error(f"--methods: unknown {sorted(unknown)}; choose among {','.join(methods)}")
    reference = []
    for prompt in prompts:
        output = target.generate(torch.tensor([prompt], device=target.device), generation_config=config)
        answer = output[0, len(prompt) :].tolist()
        reference.append(answer[: answer.index(config.eos_token_id) + 1] if config.eos_token_id in answer else answer)
    arrivals = arrival_times(len(prompts), args.rate, args.seed)
    prepared = target.config._attn_implementation
    print(f"{args.prompts}: {len(prompts)} requests arriving at {args.rate}/s (the last at {arrivals[-1]:.1f} s), "
          f"at most {args.rows} rows, {new} new tokens, greedy, {args.threads} threads, {target.device}")  # fmt: skip
    for name, extra, release in (methods[key] for key in chosen):
        release_openmp_workers() if release else keep_workers()
        if not extra:  # transformers' manager refuses the fast path's attention and switches to its paged one
            target.set_attn_implementation("sdpa")
        try:
            with target.continuous_batching_context_manager(config, continuous_batching_config=pages, **extra) as m:
                serve(m, prompts[: args.rows], [0.0] * args.rows)  # warm-up
                run = serve(m, prompts, arrivals)
        finally:
            target.set_attn_implementation(prepared)
        differing = sum(answer != alone for answer, alone in zip(run["answers"], reference))
        if extra and target.device.type == "cpu":
            assert differing == 0, f"{name}: {differing} answers differ from the target alone's"
        rate = sum(map(len, run["answers"])) / run["seconds"]
        print(f"  {name:40s} {rate:6.1f} tokens/s, latency median {statistics.median(run['latency']):5.2f} s "
              f"p90 {percentile(run['latency'], 90):5.2f} s, first token median {statistics.median(run['first']):5.2f} s "
              f"p90 {percentile(run['first'], 90):5.2f} s, {differing} of {len(prompts)} answers differing")  # fmt: skip


if __name__ == "__main__":
    main()
