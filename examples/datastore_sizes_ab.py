"""Which n-gram sizes a drafter's datastore should be searched by: an A/B in `generate()` itself.

Each setting gets its own drafter object, so that each learns its own acceptance records (they are kept per drafter),
and the settings run interleaved prompt by prompt in one process, their order alternating, against the prepared
target alone on the same prompt. Greedy outputs are asserted identical to the target alone's. docs/benchmarks.md,
"Retrieved drafts", quotes it:

    python examples/datastore_sizes_ab.py --prompts mtbench --sizes 4,3 4,3,2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_domino import prepare_for_cpu_decoding
from hf_domino.assets import chat_token_ids, load_drafter, load_prompts, load_target
from hf_domino.drafting_domino import DATASTORE_FILE, DraftDatastore


def timed(target, input_ids: list[int], max_new_tokens: int, **extra) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    output = target.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False, **extra)
    return output, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", nargs="+", default=["4,3", "4,3,2"], help="settings to compare, e.g. 4,3 4,3,2")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2")
    drafters = {}
    for setting in args.sizes:
        drafter = load_drafter(None)
        sizes = tuple(int(size) for size in setting.split(","))
        drafter.datastore = DraftDatastore.load(
            str(drafter.name_or_path) + "/" + DATASTORE_FILE, ngram_sizes=sizes
        ).build_index()
        prepare_for_cpu_decoding(target, drafter)
        drafters[setting] = drafter
    prompts = [chat_token_ids(tokenizer, messages) for messages in load_prompts(args.prompts, args.num_prompts)]
    timed(target, prompts[0][:50], 8)  # warm-up
    for drafter in drafters.values():
        timed(target, prompts[0][:50], 8, assistant_model=drafter)
    seconds = {name: [] for name in ["target", *drafters]}
    tau = {name: [] for name in drafters}
    for index, input_ids in enumerate(prompts):
        reference, elapsed = timed(target, input_ids, args.max_new_tokens)
        seconds["target"].append(elapsed)
        for name in list(drafters) if index % 2 == 0 else list(reversed(drafters)):
            output, elapsed = timed(target, input_ids, args.max_new_tokens, assistant_model=drafters[name])
            assert torch.equal(output, reference), f"sizes {name}: output differs from the target alone's"
            seconds[name].append(elapsed)
            tau[name].append(statistics.fmean(drafters[name].last_generation_stats.acceptance_lengths))
    print(f"{args.prompts}: {len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, identical outputs")
    for name in drafters:
        speedup = sum(seconds["target"]) / sum(seconds[name])
        print(f"  sizes {name:10s} {speedup:.3f}x the target alone, tau {statistics.fmean(tau[name]):.2f}")


if __name__ == "__main__":
    main()
