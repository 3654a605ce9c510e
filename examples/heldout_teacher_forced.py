"""Teacher-forced metrics of a drafter on held-out regenerated examples vs its own training examples.

Separates memorization from prompt shift: both sets come from the same prompt source, answered by the same target.

    hf-domino regenerate --target smollm2 --prompts sharegpt --skip 6000 --limit 24 --batch-size 24 \
        --max-new-tokens 192 --max-prompt-tokens 256 --threads 2 --output runs/smollm2/heldout_sharegpt.jsonl
    python examples/heldout_teacher_forced.py runs/smollm2/target_init/final runs/smollm2/heldout_sharegpt.jsonl \
        runs/smollm2/regen_sharegpt.jsonl

With a training run's `--seed`, `--draft-vocab` when it trained over one and its precision
(`ACCELERATE_MIXED_PRECISION`), it gives that run's validation figures for any drafter, e.g. the shipped one against a
continuation of it (docs/training.md, "Finishing stage 3's schedule on a CPU").
"""

from __future__ import annotations

import argparse

import torch

from hf_domino.assets import load_drafter, load_smollm2
from hf_domino.training import TrainConfig, load_examples, teacher_forced_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter")
    parser.add_argument("data", nargs="+", help="regenerated jsonl files, one row of results each")
    parser.add_argument("--num-examples", type=int, default=24, help="first examples of each file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=640, help="cut examples to this many tokens")
    parser.add_argument(
        "--seed", type=int, default=0, help="anchor seed: a training run's --seed gives its validation's own anchors"
    )
    parser.add_argument(
        "--draft-vocab", action="store_true", help="score over the drafter's draft vocabulary, as generate() drafts"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_smollm2()
    drafter = load_drafter(args.drafter)
    config = TrainConfig(num_anchors=32, max_length=args.max_length, seed=args.seed, draft_vocab=args.draft_vocab)
    print("| examples | base loss | final loss | draft-0 acc | final acc, drafts 1-5 | teacher-forced tau |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in args.data:
        examples = load_examples(path, config.max_length)[: args.num_examples]
        m = teacher_forced_metrics(drafter, target, examples, config, tokenizer.pad_token_id or 0)
        drafts = m["final_acc"][1:6]
        print(
            f"| {path} ({len(examples)}) | {m['base_loss']:.3f} | {m['final_loss']:.3f} | {m['base_acc'][0]:.3f} "
            f"| {min(drafts):.3f}-{max(drafts):.3f} | {m['train_tau']:.2f} |"
        )


if __name__ == "__main__":
    main()
