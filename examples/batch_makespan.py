"""How far a batch's last row advances per cycle when every row verifies k drafts: simulated batches against the
rows' mean, one cycle's view of the shortest row, and the price `cost_model_domino.expected_tokens(acceptance, rooms)`
gives a cycle (the cycles it saves the batch against a plain step; simulated the same way for comparison), and
what one such pricing costs on this machine (16 draft positions, 1 thread).
docs/benchmarks.md, "The batch finishes with its last row", quotes it:

    python examples/batch_makespan.py --tokens 64
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_domino.cost_model_domino import expected_tokens

# Per draft position, the chance a draft is accepted once the ones before it were: the shipped drafter on MT-Bench is
# near the first figure, and later positions hold better.
ACCEPTANCE = [0.45, 0.6, 0.65, 0.7, 0.7, 0.7, 0.7, 0.7]


def cycles(
    rooms: list[int], first: int, later: int, trials: int = 20000, acceptance: list[float] = ACCEPTANCE
) -> float:
    """Mean cycles until every row has its `rooms` tokens, the first cycle verifying `first` drafts per row and the
    others `later`; one seed for every call, so that differences between calls are precise. Also used by
    tests/test_draft_policy.py."""
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor(rooms, dtype=torch.float64)
    done, count, k = torch.zeros(trials, len(rooms), dtype=torch.float64), torch.zeros(trials), first
    while bool((done < target).any()):
        running = (done < target).any(dim=-1)
        draws = torch.rand(trials, len(rooms), len(acceptance), generator=generator)
        advance = 1 + (draws[..., :k] < torch.tensor(acceptance[:k])).long().cumprod(dim=-1).sum(dim=-1)
        done = torch.minimum(done + advance * running[:, None], target)
        count, k = count + running, later
    return float(count.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens every row generates")
    parser.add_argument("--rows", default="2,4,8")
    args = parser.parse_args()
    ks = (1, 2, 4, 8)
    mean = expected_tokens(torch.tensor(ACCEPTANCE))
    print("| rows | " + " | ".join(f"k = {k}" for k in ks) + " |")
    print("| --- |" + " ---: |" * len(ks))
    print("| 1 (the rows' mean) | " + " | ".join(f"{mean[k]:.2f}" for k in ks) + " |")
    for rows in map(int, args.rows.split(",")):
        rooms = [args.tokens] * rows
        whole = [args.tokens / cycles(rooms, k, k) for k in ks]
        shortest = [1 + sum(torch.tensor(ACCEPTANCE[: j + 1]).prod().item() ** rows for j in range(k)) for k in ks]
        priced = expected_tokens(torch.tensor([ACCEPTANCE] * rows), rooms)
        plain = cycles(rooms, 0, 0)  # == tokens: a plain step advances every row by one
        saved = [(cycles(rooms, 0, k) - cycles(rooms, k, k)) for k in ks]
        step = [cycles([n + 1 for n in rooms], 0, k) - cycles(rooms, 0, k) for k in ks]
        print(f"| {rows}, whole generations | " + " | ".join(f"{t:.2f}" for t in whole) + " |")
        print(f"| {rows}, one cycle's view of the shortest row | " + " | ".join(f"{t:.2f}" for t in shortest) + " |")
        print(
            f"| {rows}, a first cycle: simulated / priced | "
            + " | ".join(f"{1 + s / d:.2f} / {priced[k]:.2f}" for s, d, k in zip(saved, step, ks))
            + " |"
        )
        assert plain == args.tokens
    torch.set_num_threads(1)
    for rows in map(int, args.rows.split(",")):
        acceptance, rooms, seconds = torch.rand(rows, 16), [args.tokens] * rows, []
        for _ in range(300):
            start = time.perf_counter()
            expected_tokens(acceptance, rooms)
            seconds.append(time.perf_counter() - start)
        print(f"pricing {rows} rows: {sorted(seconds)[150] * 1e3:.3f} ms (median of 300)")


if __name__ == "__main__":
    main()
