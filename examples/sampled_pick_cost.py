"""What one sampled draft's pick costs on this CPU: the call's warpers and the draw over the whole vocabulary (the
draft vocabulary's logits spread, `-inf` elsewhere) or over the draft vocabulary's columns, then spread
(`processed_pick`'s two orders). docs/benchmarks.md, "Sampled drafts warped and drawn on the draft vocabulary's
columns", quotes it:

    python examples/sampled_pick_cost.py
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_domino.drafting_domino import spread_to_vocabulary

VOCAB_SIZE, DRAFT_VOCAB = 49152, 8192  # SmolLM2 and the shipped drafter's draft vocabulary


def ms_per_call(fn, reps: int = 300) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    vocab = torch.randperm(VOCAB_SIZE)[:DRAFT_VOCAB].sort().values
    columns = torch.randn(1, DRAFT_VOCAB) * 3
    ids = torch.zeros(1, 10, dtype=torch.long)
    cases = {
        "T 0.6, top-k 20, top-p 0.95": [TemperatureLogitsWarper(0.6), TopKLogitsWarper(20), TopPLogitsWarper(0.95)],
        "T 0.6": [TemperatureLogitsWarper(0.6)],
    }
    print("| warpers | spread, then warped and drawn (ms) | warped and drawn on the columns, then spread (ms) |")
    print("| --- | ---: | ---: |")
    for name, warpers in cases.items():
        processors = LogitsProcessorList(warpers)

        def spread_first(processors=processors):
            logits = processors(ids, spread_to_vocabulary(columns, vocab, VOCAB_SIZE))
            return torch.multinomial(torch.softmax(logits, -1), 1)

        def on_columns(processors=processors):
            logits = processors(ids, columns.clone())
            return torch.multinomial(torch.softmax(logits, -1), 1), spread_to_vocabulary(logits, vocab, VOCAB_SIZE)

        print(f"| {name} | {ms_per_call(spread_first):.2f} | {ms_per_call(on_columns):.2f} |")


if __name__ == "__main__":
    main()
