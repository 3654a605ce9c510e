"""Whether the adaptive policy's price of a batch's drafts is right: for every row of every verified drafting cycle,
the tokens its calibrated acceptance predicted for the chosen k against the tokens it got. docs/benchmarks.md, "The
target's cache grows in place", quotes it:

    python examples/batch_calibration.py --prompts mtbench --batch-size 4
"""

from __future__ import annotations

import argparse
import statistics

from hf_domino import policy_domino
from hf_domino.cost_model_domino import expected_tokens
from hf_domino.measure_batch import smollm2_batches


def recording(log: list[tuple[int, float, int, float]]) -> None:
    """Wraps the policy's `choose` and `observe`: (k, predicted tokens, realised tokens, first confidence) per row."""
    choose, observe = policy_domino.AdaptivePolicy.choose, policy_domino.AdaptivePolicy.observe

    def logged_choose(self, confidence, draft_seconds, limits=None):
        k = choose(self, confidence, draft_seconds, limits)
        self.priced = None
        if limits is not None and k:
            acceptance = self.record.calibration(self.confidence.flatten()).view(self.confidence.shape).clone()
            for row, limit in enumerate(limits):
                acceptance[row, limit:] = 0
            predicted = [float(expected_tokens(row)[k]) for row in acceptance]
            self.priced = k, predicted, self.confidence[:, 0].tolist()
        return k

    def logged_observe(self, **cycle):
        if cycle.get("drafted") and cycle["verified"] and getattr(self, "priced", None):
            k, predicted, first = self.priced
            rows = cycle.get("rows") or range(len(predicted))
            for row, accepted in zip(rows, cycle["accepted"]):
                log.append((k, predicted[row], 1 + accepted, first[row]))
        return observe(self, **cycle)

    policy_domino.AdaptivePolicy.choose, policy_domino.AdaptivePolicy.observe = logged_choose, logged_observe


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
    log: list[tuple[int, float, int, float]] = []
    recording(log)
    for _ in range(args.repeats):
        for batch in groups:
            target.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=drafter)
    print(f"{args.prompts}, {size} rows: {len(log)} row-cycles verified drafts")
    for k in sorted({entry[0] for entry in log}):
        chosen = [entry for entry in log if entry[0] == k]
        predicted, realised = statistics.fmean(e[1] for e in chosen), statistics.fmean(e[2] for e in chosen)
        print(f"  k = {k}: {len(chosen)} row-cycles, tokens predicted {predicted:.2f}, realised {realised:.2f}")
    for low in (0.0, 0.2, 0.4, 0.6, 0.8):
        binned = [entry for entry in log if low <= entry[3] < low + 0.2 or (low == 0.8 and entry[3] == 1.0)]
        if binned:
            held = statistics.fmean(float(e[2] > 1) for e in binned)
            print(f"  first draft's confidence {low:.1f}-{low + 0.2:.1f}: {len(binned)} row-cycles, held {held:.2f}")


if __name__ == "__main__":
    main()
