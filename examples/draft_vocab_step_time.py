"""Seconds of one training step over the whole vocabulary and over the drafter's draft vocabulary (`--draft-vocab`),
and what drawing its anchors among generate()'s own blocks adds (`--anchor-chain`).

One batch of the shipped recipe (16 held-out sequences, 32 anchors each): the target's feature forward once, then
the drafter's forward and backward a few times per vocabulary, with the batch's teacher-forced tau~ for each; then
the no-grad pass that finds generate()'s blocks (over the draft vocabulary), and tau~ at anchors drawn among them:

    python examples/draft_vocab_step_time.py src/hf_domino/checkpoints/smollm2-135m-instruct-domino \
        data/smollm2-regen/heldout_ids.safetensors
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_domino import TargetModules
from hf_domino.assets import load_drafter, load_smollm2, pad_token_id
from hf_domino.training import (
    DominoTrainingModule,
    collate,
    load_examples,
    sample_anchors,
    sample_chain_anchors,
    target_hidden_states,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", help="a drafter folder with a draft vocabulary")
    parser.add_argument("data", help="a regenerated (jsonl or packed) file")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-anchors", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_smollm2()
    drafter = load_drafter(args.drafter).train()
    if drafter.draft_vocab is None:
        raise SystemExit(f"{args.drafter} has no draft vocabulary; build one with `hf-domino draft-vocab`.")
    batch = collate(load_examples(args.data, max_length=640)[: args.batch_size], pad_token_id(target, tokenizer))
    start = time.perf_counter()
    features, _ = target_hidden_states(target, batch.input_ids, batch.attention_mask, drafter.config.target_layer_ids)
    print(f"batch {tuple(batch.input_ids.shape)}: target forward {time.perf_counter() - start:.2f} s")
    anchors, valid = sample_anchors(batch.loss_mask, args.num_anchors, torch.Generator().manual_seed(0))
    for name, vocab in (("whole vocabulary", None), ("draft vocabulary", drafter.draft_vocab)):
        module = DominoTrainingModule(drafter, TargetModules.from_target(target), vocab)
        seconds = []
        for _ in range(args.repeats):
            drafter.zero_grad(set_to_none=True)
            start = time.perf_counter()
            out = module(batch.input_ids, batch.loss_mask, batch.attention_mask, features, anchors, valid, 0.5)
            out.loss.backward()
            seconds.append(time.perf_counter() - start)
        tau = (out.accepted / out.num_blocks).item()
        print(f"{name}: drafter forward + backward {', '.join(f'{s:.2f}' for s in seconds)} s | tau~ {tau:.3f}")

    inputs = (batch.input_ids, batch.loss_mask, batch.attention_mask, features)
    start = time.perf_counter()
    chains = module.generate_blocks(*inputs)
    seconds = time.perf_counter() - start
    added = sum(tokens for chain in chains for _, tokens in chain) / sum(len(chain) for chain in chains)
    print(f"--anchor-chain: generate()'s blocks found in {seconds:.2f} s (no grad) | their acceptance {added:.3f}")
    anchors, valid = sample_chain_anchors(chains, args.num_anchors, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = module(*inputs, anchors, valid, 0.5)
    print(
        f"--anchor-chain: tau~ at {int(valid.sum())} anchors drawn among them {(out.accepted / out.num_blocks).item():.3f}"
    )


if __name__ == "__main__":
    main()
