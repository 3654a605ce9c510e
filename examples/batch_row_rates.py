"""How far apart a batch's rows advance in a first call: each row's tokens per cycle while every row is active, and
the cycles at which rows finish (a fresh drafter per group, so every call is a first call). docs/benchmarks.md, "A
batch's first call", quotes it:

    python examples/batch_row_rates.py --prompts mtbench --num-prompts 32 --batch-size 8
"""

from __future__ import annotations

import argparse

from hf_domino import batching_domino, prepare_for_cpu_decoding
from hf_domino.assets import load_drafter
from hf_domino.measure_batch import smollm2_batches


def recording(trace: list[dict[int, int]]) -> None:
    """Wraps the batch loop's `cycle`: per cycle, the tokens each active row gained."""
    cycle = batching_domino.BatchedDecoding.cycle

    def logged_cycle(self):
        before = {row: self.sequences[row].shape[0] for row in self.active}
        finished = cycle(self)
        trace.append({row: self.sequences[row].shape[0] - n for row, n in before.items()})
        return finished

    batching_domino.BatchedDecoding.cycle = logged_cycle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    rows = args.batch_size
    target, _, _, groups = smollm2_batches(args.prompts, args.num_prompts, rows)
    trace: list[dict[int, int]] = []
    recording(trace)
    for number, batch in enumerate(groups):
        drafter = load_drafter(None)
        prepare_for_cpu_decoding(target, drafter, batch_size=rows)
        trace.clear()
        target.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=drafter)
        full = [cycle for cycle in trace if len(cycle) == rows]
        rates = [sum(cycle[row] for cycle in full) / max(len(full), 1) for row in range(rows)]
        ends = sorted(max(i + 1 for i, cycle in enumerate(trace) if row in cycle) for row in range(rows))
        print(
            f"group {number}: {len(trace)} cycles, {len(full)} with every row; tokens per cycle per row there: "
            + " ".join(f"{rate:.2f}" for rate in rates)
            + f" (mean {sum(rates) / rows:.2f}, slowest {min(rates):.2f}); rows finish at cycles {ends}"
        )


if __name__ == "__main__":
    main()
