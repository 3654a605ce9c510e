"""Batches after `prepare_for_cpu_decoding(..., compile=True)`: why they take compiled plain steps.

The same left-padded batches, greedy, three ways: the target alone as compile=True runs it (a static cache, its
forward compiled), the drafter's batch loop (which keeps holes in a dynamic cache, its forward eager: what a batch
with the drafter ran before it took the compiled plain steps; `cache_implementation="dynamic"` still asks for it),
and the target alone uncompiled. A warm-up call of each first (the compiling); then `--repeats` rounds, the order
rotating; prints total seconds per way and the ratios. docs/benchmarks.md, "In one argument", quotes it:

    python examples/compiled_batches.py --batch-size 4
    python examples/compiled_batches.py --batch-size 2
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from hf_domino import prepare_for_cpu_decoding
from hf_domino.measure_batch import smollm2_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-batches", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the batch warnings say what this script measures
    target, _, drafter, batches = smollm2_batches(args.prompts, args.batch_size * args.num_batches, args.batch_size)
    prepare_for_cpu_decoding(target, drafter, batch_size=args.batch_size, compile=True)
    ways = {
        "compiled target alone": {},
        "drafter's batch loop": {"assistant_model": drafter, "cache_implementation": "dynamic"},
        "target alone, uncompiled": {"cache_implementation": "dynamic"},
    }

    def generate(batch: dict[str, torch.Tensor], kwargs: dict) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        output = target.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
        return time.perf_counter() - start, output

    for batch in batches:
        for kwargs in ways.values():
            generate(batch, kwargs)
    seconds = dict.fromkeys(ways, 0.0)
    names = list(ways)
    for repeat in range(args.repeats):
        for batch in batches:
            outputs = []
            for name in names[repeat % 3 :] + names[: repeat % 3]:
                elapsed, output = generate(batch, ways[name])
                seconds[name] += elapsed
                outputs.append(output)
            assert all(torch.equal(output, outputs[0]) for output in outputs), "outputs differ"
    compiled = seconds["compiled target alone"]
    print(
        f"{args.batch_size} rows x {args.max_new_tokens} tokens, {args.num_batches} batches x {args.repeats}: "
        + ", ".join(f"{name} {s:.2f} s ({compiled / s:.2f}x)" for name, s in seconds.items())
        + "; outputs identical"
    )


if __name__ == "__main__":
    main()
