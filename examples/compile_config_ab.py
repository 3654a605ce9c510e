"""generate() compiled on a CPU with a given compile config: what its first calls cost, and its speed after.

In a fresh process: the offline SmolLM2 target and the shipped drafter, `prepare_for_cpu_decoding`, then greedy calls
on a static cache with the target's forward compiled (`CompileConfig()`, or `CompileConfig(dynamic=True)` with
`--dynamic`): the first two calls of the target alone and then of the drafter, timed (the compiling), then two rounds
over the prompts, tokens/s per way. Run each config with its own empty inductor cache to time compiling from scratch.
docs/benchmarks.md, "In one argument", quotes it:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python examples/compile_config_ab.py
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python examples/compile_config_ab.py --dynamic
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import CompileConfig

from hf_domino import prepare_for_cpu_decoding
from hf_domino.assets import encode_chat, load_drafter, load_target
from hf_domino.cpu_fast_path import compiling_on_any_device
from hf_domino.prompt_sets import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dynamic", action="store_true", help="CompileConfig(dynamic=True)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter()
    prepare_for_cpu_decoding(target, drafter)
    compile_config = compiling_on_any_device(CompileConfig(dynamic=True) if args.dynamic else CompileConfig())
    prompts = [encode_chat(tokenizer, messages) for messages in load_prompts("mtbench", args.num_prompts)]
    ways = {"target": {}, "drafter": {"assistant_model": drafter}}

    def generate(input_ids: torch.LongTensor, **extra) -> tuple[float, int]:
        start = time.perf_counter()
        output = target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), cache_implementation="static",
            compile_config=compile_config, do_sample=False, max_new_tokens=args.max_new_tokens, **extra,
        )  # fmt: skip
        return time.perf_counter() - start, output.shape[1] - input_ids.shape[1]

    for name, extra in ways.items():
        for index in range(2):
            print(f"first {name} call {index}: {generate(prompts[index], **extra)[0]:.1f} s", flush=True)
    for round_ in range(2):
        totals = {name: [0.0, 0] for name in ways}
        for input_ids in prompts:
            for name, extra in ways.items():
                seconds, tokens = generate(input_ids, **extra)
                totals[name][0] += seconds
                totals[name][1] += tokens
        print(f"round {round_}: " + ", ".join(f"{n} {t / s:.2f} tokens/s" for n, (s, t) in totals.items()))


if __name__ == "__main__":
    main()
