"""What torch's work costs in a second thread on a CPU, where a manager (`init_continuous_batching`, transformers' or
the drafted one) does its model work: one request through `generate()` in the main thread and in a second thread
(with torch's threads as set, and with one), then through the drafted manager (plain steps only, and drafting), and
a single prepacked product of a few rows in each thread. SmolLM2 on the CPU fast path, means over `--prompts`
MT-Bench prompts of `--tokens` tokens each. docs/benchmarks.md quotes it:

    python examples/thread_penalty.py
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from transformers import GenerationConfig

from hf_domino import prepare_for_cpu_decoding
from hf_domino.assets import chat_token_ids, load_drafter, load_target
from hf_domino.prompt_sets import load_prompts


def in_thread(work, threads: int | None = None):
    """`work()` in a second, long-lived thread (with `threads` torch threads there, if given)."""
    out = []

    def body() -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        out.append(work())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return out[0]


def product_microseconds(rows: int = 4) -> float:
    """The fastest quarter's mean of a prepacked product of `rows` rows by a 1536 x 576 weight."""
    weight = torch.randn(1536, 576)
    packed, x = torch.ops.mkldnn._reorder_linear_weight(weight, None), torch.randn(1, rows, 576)
    times = []
    for _ in range(1050):
        start = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        times.append(time.perf_counter() - start)
    return statistics.fmean(sorted(times[50:])[:250]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
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

    def managed(**options) -> float:
        seconds = []
        with target.continuous_batching_context_manager(config, assistant_model=drafter, **options) as manager:
            for prompt in [prompts[0], *prompts]:
                start = time.perf_counter()
                manager.get_result(manager.add_request(prompt), timeout=600)
                seconds.append(time.perf_counter() - start)
        return statistics.fmean(seconds[1:])

    print(f"one request of {args.tokens} tokens, mean of {args.prompts}, {args.threads} torch threads:")
    print(f"  generate(), main thread                   {generate_each():.2f} s")
    print(f"  generate(), a second thread               {in_thread(generate_each):.2f} s")
    print(f"  generate(), a second thread of 1 thread   {in_thread(generate_each, 1):.2f} s")
    print(
        f"  the drafted manager, plain steps only     {managed(num_speculative_tokens=0, domino_lookup=False):.2f} s"
    )
    print(f"  the drafted manager                       {managed():.2f} s")
    print(f"a prepacked product of 4 rows: main thread {product_microseconds():.0f} us, "
          f"a second thread {in_thread(product_microseconds):.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()
