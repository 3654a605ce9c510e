"""Sampling several answers per prompt (`num_return_sequences`): the drafter's loop reading each prompt once and
sharing its columns among the copies (the default), against reading every copy (`SHARE_PROMPT_COPIES = False`, as
the target alone's batched prefill does), and against the target alone. SmolLM2 target, shipped drafter, CPU fast
path, the target's own sampling settings (its generation config).

Each prompt is one call of `--copies` sequences; per prompt and repeat the three ways run in a shuffled order, each
from the same seed (the drafted ways' draws still part where the adaptive policy, which reads the clock, chooses
other draft lengths). Per way: the median over repeats of each prompt's call, summed over prompts, and of its prefill
(the call's first forward). docs/benchmarks.md quotes it:

    python examples/prompt_copies.py --prompts humaneval --num-prompts 4 --copies 4 --max-new-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch

from hf_domino import batch_prompts_domino, prepare_for_cpu_decoding
from hf_domino.assets import chat_token_ids, load_drafter, load_target
from hf_domino.prompt_sets import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter(None)
    prepare_for_cpu_decoding(target, drafter, batch_size=args.copies)
    prompts = [chat_token_ids(tokenizer, messages) for messages in load_prompts(args.prompts, args.num_prompts)]
    batches = [{"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
               for ids in prompts]  # fmt: skip
    prefill: list[float] = []  # per call, its first forward's seconds
    untimed = target.forward

    @functools.wraps(untimed)  # its signature: the loops pass logits_to_keep only to a forward that names it
    def timed(*positional, **keywords):
        start = time.perf_counter()
        output = untimed(*positional, **keywords)
        if not prefill:
            prefill.append(time.perf_counter() - start)
        return output

    target.forward = timed
    ways = {
        "target alone": dict(),
        "drafter, every copy read": dict(assistant_model=drafter, share=False),
        "drafter, each prompt read once (default)": dict(assistant_model=drafter, share=True),
    }

    def call(batch, way: dict, seed: int) -> tuple[float, float]:
        options = dict(way)
        default = batch_prompts_domino.SHARE_PROMPT_COPIES
        batch_prompts_domino.SHARE_PROMPT_COPIES = options.pop("share", True)
        prefill.clear()
        torch.manual_seed(seed)
        start = time.perf_counter()
        try:
            target.generate(**batch, do_sample=True, num_return_sequences=args.copies,
                            max_new_tokens=args.max_new_tokens, **options)  # fmt: skip
        finally:
            batch_prompts_domino.SHARE_PROMPT_COPIES = default
        return time.perf_counter() - start, prefill[0]

    call(batches[0], ways["drafter, each prompt read once (default)"], 0)  # warm-up: the policy's cost table
    call(batches[0], ways["drafter, every copy read"], 0)
    seconds = {name: [[] for _ in batches] for name in ways}
    prefills = {name: [[] for _ in batches] for name in ways}
    order = random.Random(args.seed)
    for repeat in range(args.repeats):
        for index, batch in enumerate(batches):
            for name in order.sample(list(ways), len(ways)):
                wall, read = call(batch, ways[name], args.seed + 1000 * repeat + index)
                seconds[name][index].append(wall)
                prefills[name][index].append(read)
    widths = [batch["input_ids"].shape[1] for batch in batches]
    print(f"{args.prompts}: {len(batches)} prompts of {min(widths)}-{max(widths)} tokens, {args.copies} sequences "
          f"each, {args.max_new_tokens} new tokens, sampling, {torch.get_num_threads()} threads; medians of "
          f"{args.repeats} repeats, summed over prompts")  # fmt: skip
    alone = sum(statistics.median(each) for each in seconds["target alone"])
    for name in ways:
        total = sum(statistics.median(each) for each in seconds[name])
        read = sum(statistics.median(each) for each in prefills[name])
        print(f"  {name:42s} {total:6.2f} s ({alone / total:.2f}x the target alone), prefill {read:5.2f} s")


if __name__ == "__main__":
    main()
