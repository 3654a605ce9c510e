"""What one retrieval from the shipped drafter's datastore costs on the host: `DraftDatastore.lookup` on the last
tokens of real generations, the index built beforehand. Sequences are the prompts of a prompt set followed by the
target's greedy answer, cut at every 8th token (where a lookup would run in `generate()`). docs/benchmarks.md,
"Retrieved drafts", quotes it:

    python examples/datastore_lookup_cost.py --prompts mtbench --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_domino.assets import encode_chat, load_drafter, load_target
from hf_domino.prompt_sets import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-drafts", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    datastore = load_drafter(None).datastore
    start = time.perf_counter()
    datastore.build_index()
    print(f"index built in {time.perf_counter() - start:.1f} s ({datastore.tokens.numel():,} tokens)")
    sequences = []
    for messages in load_prompts(args.prompts, args.num_prompts):
        prompt = encode_chat(tokenizer, messages)
        output = target.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
        sequences += [output[:, :end] for end in range(prompt.shape[1] + 1, output.shape[1] + 1, 8)]
    for sequence in sequences[:20]:  # warm-up
        datastore.lookup(sequence, args.max_drafts)
    times, found = [], []
    for sequence in sequences:
        start = time.perf_counter()
        drafts = datastore.lookup(sequence, args.max_drafts)
        times.append(time.perf_counter() - start)
        found.append(0 if drafts is None else drafts.shape[1])
    print(
        f"{len(sequences)} lookups: median {statistics.median(times) * 1e3:.3f} ms, mean "
        f"{statistics.fmean(times) * 1e3:.3f} ms; drafts found at {sum(n > 0 for n in found) / len(found):.0%} of "
        f"them, {statistics.fmean(n for n in found if n) if any(found) else 0:.1f} drafts on average where found"
    )


if __name__ == "__main__":
    main()
