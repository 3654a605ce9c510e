"""Where a batch's time goes against the batched target alone: the cycles that run with every row, and the tail that
runs after the first rows finished. The target alone advances its rows in lockstep, so its rows reach
`max_new_tokens` together; with a drafter, rows that drafted or copied well finish first and the last rows decode
in a smaller batch that costs nearly as much per step. docs/benchmarks.md ("The batch's tail") quotes it:

    python examples/batch_tail.py --prompts mtbench --batch-size 4
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_domino import assets, batching_domino
from hf_domino.measure_batch import generated_tokens, smollm2_batches


def recording(cycles: list[tuple[int, int, float]]) -> None:
    """Wraps the batch loop's `cycle`: (rows active, tokens the rows added, seconds) per cycle."""
    cycle = batching_domino.BatchedDecoding.cycle

    def recorded(self):
        rows, start = len(self.active), time.perf_counter()
        finished = cycle(self)
        cycles.append((rows, sum(self.stats.acceptance_lengths[-rows:]), time.perf_counter() - start))
        return finished

    batching_domino.BatchedDecoding.cycle = recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    size = args.batch_size
    target, tokenizer, drafter, groups = smollm2_batches(args.prompts, args.num_prompts, size)
    cycles: list[tuple[int, int, float]] = []
    recording(cycles)
    options = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    target.generate(**groups[0], **options, assistant_model=drafter)  # warm-up: kernels, the policy's cost table
    forwards: list[float] = []  # the start of each target forward, and the end of the first (the prefill)
    target.register_forward_pre_hook(lambda *_: forwards.append(time.perf_counter()))
    eos = assets.eos_token_ids(target, tokenizer)
    alone = with_drafter = useful = stepping = 0.0
    cycles.clear()
    for _ in range(args.repeats):
        for batch in groups:
            forwards.clear()
            start = time.perf_counter()
            reference = target.generate(**batch, **options)
            alone += time.perf_counter() - start
            stepping += time.perf_counter() - forwards[1]  # from the first step on: the prefill is in neither rate
            # Tokens up to each row's EOS, the first (the prefill's) excepted: rows that ended early pad, not work.
            useful += generated_tokens(reference, batch["input_ids"].shape[1], eos) - size
            start = time.perf_counter()
            output = target.generate(**batch, **options, assistant_model=drafter)
            with_drafter += time.perf_counter() - start
            assert torch.equal(output, reference), "output differs from the target alone's"
    print(f"{args.prompts}, {size} rows: {alone / with_drafter:.3f}x the target alone (outputs identical)")
    rate_alone = useful / stepping
    for name, part in (
        ("all rows", [c for c in cycles if c[0] == size]),
        ("tail", [c for c in cycles if c[0] < size]),
    ):
        seconds, tokens = sum(c[2] for c in part), sum(c[1] for c in part)
        share = seconds / sum(c[2] for c in cycles)
        print(
            f"  {name:8s} {len(part):4d} cycles, {share:4.0%} of the cycles' time, "
            f"{tokens / seconds / rate_alone:.2f}x the target alone's tokens per second"
        )


if __name__ == "__main__":
    main()
