"""What torch's work costs in a second thread on a CPU, where a manager (`init_continuous_batching`, transformers' or
the drafted one) does its model work, and what releasing the main thread's OpenMP workers gives back.

Each way of running, in `--rounds` rounds in a shuffled order (medians reported): one request at a time through
`generate()` in the main thread, in a second thread with the main thread's OpenMP workers kept (as they are after
any parallel work of its own) and released (`release_openmp_workers`, what a drafted manager's `start()` does on a
CPU), and in a second thread running one torch thread; then through the drafted manager (plain steps only, and
drafting), the main thread's workers kept and released. First, what one OpenMP parallel region costs (the sum of
131,072 floats), where the difference shows without the noise of whole requests: in the main thread, in a second
thread (workers kept, released), and in the drafted manager's own thread (read by a wrapper around its
`Serving.step`). SmolLM2 on the CPU fast path, `--prompts` MT-Bench prompts of `--tokens` tokens each (after a
warm-up request). docs/benchmarks.md quotes it:

    python examples/thread_penalty.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable

import torch
from transformers import GenerationConfig

from hf_domino import batching_manager_domino, continuous_batching_domino, prepare_for_cpu_decoding
from hf_domino.assets import chat_token_ids, load_drafter, load_target
from hf_domino.batching_manager_domino import release_openmp_workers
from hf_domino.prompt_sets import load_prompts


def keep_workers() -> None:
    """Parallel work in this thread, so that its OpenMP workers run (as after any torch work of the caller's)."""
    torch.ones(1 << 22).sum()


def in_thread(work: Callable[[], float], threads: int | None = None, release: bool = False) -> float:
    """`work()` in a second thread (with `threads` torch threads there, if given), the calling thread's OpenMP
    workers released first (`release`) or kept."""
    release_openmp_workers() if release else keep_workers()
    out, previous = [], torch.get_num_threads()

    def body() -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            out.append(work())
        finally:  # torch's thread count is the process's, not the thread's: the other ways must not run at one
            torch.set_num_threads(previous)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return out[0]


def region_microseconds(repeats: int = 3000) -> float:
    """The median time of one parallel region: a sum over 131,072 floats, which torch splits over its threads."""
    x, times = torch.ones(1 << 17), []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times[repeats // 6 :]) * 1e6


def through_manager(target, drafter, config, prompts, release: bool, **options) -> list[float]:
    """Seconds per request through a drafted manager, one request at a time (`RELEASE_CALLER_OPENMP` as `release`,
    the main thread's workers running before `start()`)."""
    default, batching_manager_domino.RELEASE_CALLER_OPENMP = batching_manager_domino.RELEASE_CALLER_OPENMP, release
    keep_workers()
    seconds = []
    try:
        with target.continuous_batching_context_manager(config, assistant_model=drafter, **options) as manager:
            for prompt in prompts:
                start = time.perf_counter()
                manager.get_result(manager.add_request(prompt), timeout=600)
                seconds.append(time.perf_counter() - start)
    finally:
        batching_manager_domino.RELEASE_CALLER_OPENMP = default
    return seconds


def manager_region_microseconds(target, drafter, config, prompt, release: bool) -> float:
    """`region_microseconds` in a drafted manager's thread, before its first step (`through_manager`)."""
    measured, step = [], continuous_batching_domino.Serving.step

    def measuring_step(serving):
        if not measured:
            measured.append(region_microseconds())
        return step(serving)

    continuous_batching_domino.Serving.step = measuring_step
    try:
        through_manager(target, drafter, config, [prompt], release)
    finally:
        continuous_batching_domino.Serving.step = step
    return measured[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter(None)
    prepare_for_cpu_decoding(target, drafter, batch_size=4)
    prompts = [chat_token_ids(tokenizer, messages) for messages in load_prompts("mtbench", args.prompts)]
    config = GenerationConfig(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                              eos_token_id=target.generation_config.eos_token_id)  # fmt: skip

    def generate_each() -> float:
        seconds = []
        for prompt in [prompts[0], *prompts]:  # the first a warm-up
            start = time.perf_counter()
            target.generate(torch.tensor([prompt]), generation_config=config)
            seconds.append(time.perf_counter() - start)
        return statistics.fmean(seconds[1:])

    def managed(release: bool, **options) -> float:
        seconds = through_manager(target, drafter, config, [prompts[0], *prompts], release, **options)
        return statistics.fmean(seconds[1:])  # the first a warm-up

    regions = {
        "main thread": lambda: keep_workers() or region_microseconds(),
        "a second thread, the main thread's OpenMP workers kept": lambda: in_thread(region_microseconds),
        "a second thread, ... released": lambda: in_thread(region_microseconds, release=True),
        "the drafted manager's thread, the main thread's workers kept": lambda: manager_region_microseconds(
            target, drafter, config, prompts[0], release=False
        ),
        "the drafted manager's thread, ... released (the default)": lambda: manager_region_microseconds(
            target, drafter, config, prompts[0], release=True
        ),
    }
    plain = dict(num_speculative_tokens=0, domino_lookup=False)
    ways = {
        "generate(), main thread": generate_each,
        "generate(), a second thread, the main thread's OpenMP workers kept": lambda: in_thread(generate_each),
        "generate(), a second thread, ... released": lambda: in_thread(generate_each, release=True),
        "generate(), a second thread of 1 torch thread": lambda: in_thread(generate_each, threads=1),
        "the drafted manager, plain steps only, the main thread's workers kept": lambda: managed(False, **plain),
        "the drafted manager, plain steps only, ... released (the default)": lambda: managed(True, **plain),
        "the drafted manager, the main thread's workers kept": lambda: managed(False),
        "the drafted manager, ... released (the default)": lambda: managed(True),
    }
    order = random.Random(args.seed)
    print(
        f"{args.threads} torch threads; medians of {args.rounds} rounds in shuffled orders (each round's in brackets)"
    )
    print("one parallel region, microseconds:")
    report(regions, args.rounds, order)
    print(f"one request of {args.tokens} tokens, mean of {args.prompts}, seconds:")
    report(ways, args.rounds, order)


def report(ways: dict[str, Callable[[], float]], rounds: int, order: random.Random) -> None:
    """Runs each of `ways` once per round, in a shuffled order per round, and prints their medians."""
    measured: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name in order.sample(list(ways), len(ways)):
            measured[name].append(ways[name]())
    for name, values in measured.items():
        print(f"  {name:72} {statistics.median(values):7.2f}  [{', '.join(f'{v:.2f}' for v in values)}]")


if __name__ == "__main__":
    main()
