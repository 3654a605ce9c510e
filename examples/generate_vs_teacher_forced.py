"""Acceptance through generate() against the teacher-forced estimate, on the same held-out examples.

Teacher forcing scores blocks at uniformly random anchors; generate() starts each block right after the target's
own token, which, after a rejected draft, is where the drafter just failed. This prints, for the same prompts
(greedy generate() reproduces the regenerated answers, which is checked), generate()'s acceptance, the teacher-forced
acceptance at generate()'s own anchors (equal, block for block: the gap is where blocks start, not a train/inference
mismatch) and the teacher-forced estimate at random anchors:

    python examples/generate_vs_teacher_forced.py src/hf_domino/checkpoints/smollm2-135m-instruct-domino \
        data/smollm2-regen/heldout_ids.safetensors --skip 40 --num-examples 8
"""

from __future__ import annotations

import argparse

import torch

from hf_domino.acceptance import block_anchors, generate_with_acceptance, mean_acceptance_length
from hf_domino.assets import load_drafter, load_smollm2, pad_token_id
from hf_domino.training import Example, TrainConfig, load_examples, teacher_forced_acceptance, teacher_forced_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter")
    parser.add_argument("data", help="a regenerated (jsonl or packed) file")
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--num-examples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_smollm2()
    pad = pad_token_id(target, tokenizer)
    drafter = load_drafter(args.drafter)
    examples = load_examples(args.data, max_length=640)[args.skip : args.skip + args.num_examples]
    lengths, same_anchors, scored = [], [], []
    for example in examples:
        prompt_length = len(example.input_ids) - sum(example.loss_mask)
        output, accepted = generate_with_acceptance(
            target,
            torch.tensor([example.input_ids[:prompt_length]]),
            assistant_model=drafter,
            draft_policy="fixed",
            num_speculative_tokens=drafter.config.num_drafts,
            domino_lookup=False,  # the drafter's own blocks
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        end = output.shape[1]
        reproduced = output[0].tolist() == example.input_ids[:end]
        # Every block but the last, which generate() cuts to the room max_new_tokens leaves.
        at_anchors = teacher_forced_acceptance(drafter, target, output, block_anchors(prompt_length, accepted))[:-1]
        differing = sum(a != b for a, b in zip(at_anchors, accepted))
        print(
            f"generate(): {mean_acceptance_length(accepted[:-1]):.3f} tokens per forward, same answer: {reproduced}, "
            f"teacher-forced at its anchors: {mean_acceptance_length(at_anchors):.3f} ({differing} blocks differ)"
        )
        lengths += accepted[:-1]
        same_anchors += at_anchors
        scored.append(Example(example.input_ids[:end], example.loss_mask[:end]))  # the span generate() produced
    teacher_forced = teacher_forced_metrics(drafter, target, scored, TrainConfig(num_anchors=32, max_length=640), pad)
    print(f"generate(), pooled: {mean_acceptance_length(lengths):.3f}")
    print(f"teacher-forced at generate()'s anchors, pooled: {mean_acceptance_length(same_anchors):.3f}")
    print(f"teacher-forced tau~ at random anchors on the same tokens: {teacher_forced['train_tau']:.3f}")


if __name__ == "__main__":
    main()
