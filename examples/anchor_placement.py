"""Why generate() accepts less than teacher forcing at random anchors: where blocks start, or how often?

For held-out regenerated answers (the target's own greedy tokens, which greedy generate() reproduces), this scores a
teacher-forced block at *every* anchor of each answer (which drafts block for block as
generate() does; `DominoTrainingModule.acceptance_everywhere`) and compares these averages of the same per-anchor
acceptance `a(p)`:

- uniform: the mean of `a(p)` over every anchor, what training's random anchors estimate (tau~);
- chain: the anchors generate() itself visits, `p <- p + a(p)` from the end of the prompt (its acceptance, exactly);
- harmonic: `1 / mean(1 / a(p))`, what a chain visiting every stretch of text in proportion to `1 / a` would see
  (a block that advances `a` tokens is one of `1 / a` blocks per token there);
- walks of w blocks: from every anchor, the w blocks `generate()` would draft from there, all of them pooled (w = 1
  is uniform): whether following `generate()` a few blocks from random starts would place training's blocks where
  `generate()`'s start (it does not, hence `hf-domino train --anchor-chain`, which draws them from the chain itself).

    python examples/anchor_placement.py src/hf_domino/checkpoints/smollm2-135m-instruct-domino \
        data/smollm2-regen/heldout_ids.safetensors --num-examples 40
"""

from __future__ import annotations

import argparse
import statistics

import torch

from hf_domino import TargetModules
from hf_domino.assets import load_drafter, load_smollm2
from hf_domino.training import DominoTrainingModule, generate_chain, load_examples, target_context_features


def _walk(acceptance: list[int], start: int, blocks: int, end: int) -> list[int]:
    """The acceptance of the first `blocks` blocks generate() drafts from `start` (those that start before `end`)."""
    seen, position = [], start
    while len(seen) < blocks and position < end:
        seen.append(acceptance[position])
        position += acceptance[position]
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter")
    parser.add_argument("data", help="a regenerated (jsonl or packed) file")
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--num-examples", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_smollm2()
    drafter = load_drafter(args.drafter)
    examples = load_examples(args.data, max_length=640)[args.skip : args.skip + args.num_examples]
    walks = (2, 4, 8, 16)
    every, visited, walked = [], [], {w: [] for w in walks}
    module = DominoTrainingModule(drafter, TargetModules.from_target(target), drafter.draft_vocab)  # as generate()
    layers = drafter.config.target_layer_ids
    for example in examples:
        prompt_length = len(example.input_ids) - sum(example.loss_mask)
        ids, loss_mask = torch.tensor([example.input_ids]), torch.tensor([example.loss_mask])
        ones = torch.ones_like(ids)
        features = target_context_features(target, ids, ones, layers)
        # From prompt_length, the first generated token: generate()'s first anchor (acceptance.block_anchors).
        acceptance = module.acceptance_everywhere(ids, loss_mask, ones, features)[0, prompt_length:-1].tolist()
        every += acceptance[:-16]  # anchors whose block has room for every draft
        visited += [tokens for _, tokens in generate_chain([0] * prompt_length + acceptance, prompt_length)]
        full = len(acceptance) - 16
        for q in range(full):
            for w in walks:
                walked[w] += _walk(acceptance, q, w, full)
    print(f"{len(examples)} held-out answers, {len(every)} anchors, {len(visited)} generate() blocks")
    print(f"uniform (tau~ at random anchors): {statistics.mean(every):.3f}")
    print(f"chain (generate()'s own anchors): {statistics.mean(visited):.3f}")
    print(f"harmonic mean over every anchor:  {1 / statistics.mean(1 / a for a in every):.3f}")
    for w in walks:
        print(f"walks of {w:2d} blocks from every anchor: {statistics.mean(walked[w]):.3f}")


if __name__ == "__main__":
    main()
