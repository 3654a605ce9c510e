"""Builds a drafter's datastore (`draft_datastore.safetensors`) from the target's own answers in packed data files.

The datastore holds the response tokens (the target's words, not the prompts: offline on MT-Bench both draft alike,
1.858 and 1.864 tokens per forward, docs/benchmarks.md) of the drafter's training data. `generate()` retrieves drafts
from it where the text itself offers no copy (`domino_datastore`, docs/usage.md). The shipped drafter's came from:

    python examples/build_datastore.py --data data/smollm2-regen/ids.safetensors \
        --output src/hf_domino/checkpoints/smollm2-135m-instruct-domino/draft_datastore.safetensors
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hf_domino.copied_drafts_domino import DraftDatastore
from hf_domino.training import load_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", required=True, help="packed data files (hf-domino regenerate/pack)")
    parser.add_argument("--output", required=True, help="the datastore file to write (next to the drafter's weights)")
    parser.add_argument("--max-length", type=int, default=640, help="as in training: longer examples are cut")
    args = parser.parse_args()
    answers = [
        [token for token, is_answer in zip(example.input_ids, example.loss_mask) if is_answer]
        for path in args.data
        for example in load_examples(path, max_length=args.max_length)
    ]
    datastore = DraftDatastore.from_sequences(answer for answer in answers if answer)
    output = Path(args.output)
    partial = output.with_name(f".{output.name}.{os.getpid()}.partial")
    try:
        datastore.save(str(partial))
        os.replace(partial, output)  # all or nothing
    finally:
        partial.unlink(missing_ok=True)
    tokens = int((datastore.tokens >= 0).sum())
    print(f"{output}: {len(answers)} answers, {tokens} tokens, {output.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
