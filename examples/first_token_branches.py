"""What verifying several first drafts at once would accept: a tree of n first-token branches, offline.

A block's acceptance is bounded by its first draft (right about half of the time with the shipped drafter), and
every later draft waits on it. A tree of n branches would verify the block after each of the drafter's n likeliest
first tokens, each continued by the Domino head from it, in one target forward (n times the drafts, which costs
little where verification is flat in its length: a GPU, or a CPU's fast path up to about 17 tokens). This scores
such blocks teacher-forced on held-out answers, at every anchor and along the chain of blocks generate() would draft
(`DominoTrainingModule.acceptance_everywhere(..., first_draft_branches=n)`, then `generate_chain`; n = 1 is
generate()'s own acceptance, checked in the tests). With k drafts per branch a block adds at most 1 + k tokens, and a
tree verifies 1 + n * k: compare trees with single blocks of the same width. Greedy, the drafter's drafts only (no
copies).

    python examples/first_token_branches.py src/hf_domino/checkpoints/smollm2-135m-instruct-domino \
        data/smollm2-regen/heldout_ids.safetensors --num-examples 40
"""

from __future__ import annotations

import argparse
import statistics

import torch

from hf_domino import TargetModules
from hf_domino.assets import load_drafter, load_smollm2
from hf_domino.training import DominoTrainingModule, generate_chain, load_examples, target_context_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter")
    parser.add_argument("data", help="a regenerated (jsonl or packed) file")
    parser.add_argument("--num-examples", type=int, default=40)
    parser.add_argument("--branches", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 8, 16], help="drafts per branch, k")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_smollm2()
    drafter = load_drafter(args.drafter)
    examples = load_examples(args.data, max_length=640)[: args.num_examples]
    module = DominoTrainingModule(drafter, TargetModules.from_target(target), drafter.draft_vocab)  # as generate()
    cells = [(n, k) for n in args.branches for k in args.drafts]
    every = {cell: [] for cell in cells}
    chain = {cell: [] for cell in cells}
    for example in examples:
        prompt_length = len(example.input_ids) - sum(example.loss_mask)
        ids, loss_mask = torch.tensor([example.input_ids]), torch.tensor([example.loss_mask])
        ones = torch.ones_like(ids)
        features = target_context_features(target, ids, ones, drafter.config.target_layer_ids)
        for n in args.branches:
            scored = module.acceptance_everywhere(ids, loss_mask, ones, features, first_draft_branches=n)
            for k in args.drafts:  # a block of k drafts per branch adds at most 1 + k
                acceptance = scored[0, prompt_length:-1].clamp(max=1 + k).tolist()
                every[n, k] += acceptance[: -drafter.config.num_drafts]  # anchors with room for every draft
                chain[n, k] += [added for _, added in generate_chain([0] * prompt_length + acceptance, prompt_length)]
    print(f"{len(examples)} held-out answers, {len(every[cells[0]])} anchors")
    print(
        "| branches n | drafts per branch k | tokens verified, 1 + n k | at every anchor | along generate()'s chain |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n, k in sorted(cells, key=lambda cell: (1 + cell[0] * cell[1], cell[0])):
        print(f"| {n} | {k} | {1 + n * k} | {statistics.mean(every[n, k]):.3f} | {statistics.mean(chain[n, k]):.3f} |")


if __name__ == "__main__":
    main()
