"""How far a batch's last row advances per cycle when every row verifies k drafts: simulated batches against the
rows' mean, one cycle's view of the shortest row, and the price `cost_model_domino.expected_tokens(acceptance, rooms)`
gives a cycle (the cycles it saves the batch against a plain step; simulated the same way for comparison); the same
for rows that lag, priced by their paces and by what later cycles cost; and what one such pricing costs on this
machine (16 draft positions, 1 thread); with `--target-shares`, the share of the SmolLM2 target's verification that
does not grow with the rows. docs/benchmarks.md, "The batch finishes with its last row" and "A batch's first call",
quotes it:

    python examples/batch_makespan.py --tokens 64
    python examples/batch_makespan.py --target-shares
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
    rooms: list[int],
    first: int,
    later: int,
    trials: int = 20000,
    acceptance: list[float] | list[list[float]] = ACCEPTANCE,
    fixed_share: float = 1.0,
) -> float:
    """Mean cycles until every row has its `rooms` tokens, the first cycle verifying `first` drafts per row and the
    others `later`; `acceptance` per draft position, shared by the rows or one list per row. A cycle counts
    `fixed_share` plus the rest times the share of rows still generating (its cost, where a cycle of every row costs
    1). One seed for every call, so that differences between calls are precise. Also used by
    tests/test_draft_policy.py."""
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor(rooms, dtype=torch.float64)
    chances = torch.tensor(acceptance).expand(len(rooms), -1)
    done, count, k = (
        torch.zeros(trials, len(rooms), dtype=torch.float64),
        torch.zeros(trials, dtype=torch.float64),
        first,
    )
    while bool((done < target).any()):
        generating = (done < target).double()
        running = generating.amax(dim=-1)
        draws = torch.rand(trials, len(rooms), chances.shape[1], generator=generator)
        advance = 1 + (draws[..., :k] < chances[:, :k]).long().cumprod(dim=-1).sum(dim=-1)
        done = torch.minimum(done + advance * running[:, None], target)
        count += running * (fixed_share + (1 - fixed_share) * generating.mean(dim=-1))
        k = later
    return float(count.mean())


def first_cycle_worth(
    rooms: list[int],
    k: int,
    acceptance: list[float] | list[list[float]] = ACCEPTANCE,
    fixed_share: float = 1.0,
    trials: int = 20000,
) -> float:
    """What a first cycle verifying k drafts per row saves simulated batches whose later cycles verify k, over what a
    plain step saves them: the price `expected_tokens` should give it. Also used by tests/test_draft_policy.py."""
    plain_first = cycles(rooms, 0, k, trials, acceptance, fixed_share)
    step = cycles([n + 1 for n in rooms], 0, k, trials, acceptance, fixed_share) - plain_first
    return 1 + (plain_first - cycles(rooms, k, k, trials, acceptance, fixed_share)) / step


def kept_paces(acceptance: list[list[float]], k: int) -> list[float]:
    """The paces (`cost_model_domino.row_paces`) of rows that keep theirs: each row's drafts accepted per cycle of k
    over the rows' mean. Also used by tests/test_draft_policy.py."""
    accepted = [expected_tokens(torch.tensor(row))[k].item() - 1 for row in acceptance]
    return [n / (sum(accepted) / len(accepted)) for n in accepted]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens every row generates")
    parser.add_argument("--rows", default="2,4,8")
    parser.add_argument(
        "--target-shares",
        action="store_true",
        help="only print the share of a verification that does not grow with the rows, as the SmolLM2 target's "
        "verify-cost table (measured by prepare_for_cpu_decoding, 2 threads) reads it",
    )
    args = parser.parse_args()
    if args.target_shares:
        target_shares([int(rows) for rows in args.rows.split(",")])
        return
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
        print(f"| {rows}, whole generations | " + " | ".join(f"{t:.2f}" for t in whole) + " |")
        print(f"| {rows}, one cycle's view of the shortest row | " + " | ".join(f"{t:.2f}" for t in shortest) + " |")
        print(
            f"| {rows}, a first cycle: simulated / priced | "
            + " | ".join(f"{first_cycle_worth(rooms, k):.2f} / {priced[k]:.2f}" for k in ks)
            + " |"
        )
        assert plain == args.tokens
    paced_rows(args.tokens)
    torch.set_num_threads(1)
    for rows in map(int, args.rows.split(",")):
        acceptance, rooms, seconds = torch.rand(rows, 16), [args.tokens] * rows, []
        paces, share = torch.rand(rows).add(0.5).tolist(), lambda num_tokens: 0.3
        for _ in range(300):
            start = time.perf_counter()
            expected_tokens(acceptance, rooms, paces, share)
            seconds.append(time.perf_counter() - start)
        print(f"pricing {rows} rows: {sorted(seconds)[150] * 1e3:.3f} ms (median of 300)")


def target_shares(batch_sizes: list[int]) -> None:
    from hf_domino import prepare_for_cpu_decoding
    from hf_domino.assets import load_drafter, load_target
    from hf_domino.batch_policy_domino import BatchVerifyCost
    from hf_domino.cost_model_domino import cached_verify_cost

    torch.set_num_threads(2)
    target, _ = load_target("smollm2", device="cpu")
    prepare_for_cpu_decoding(target, load_drafter(), batch_size=max(batch_sizes))
    table, ks = cached_verify_cost(target), (0, 1, 2, 4, 8, 16)
    print("| rows | " + " | ".join(f"k = {k}" for k in ks) + " |")
    print("| --- |" + " ---: |" * len(ks))
    for rows in batch_sizes:
        shares = [BatchVerifyCost(table, rows).fixed_share(1 + k) for k in ks]
        print(f"| {rows} | " + " | ".join(f"{share:.2f}" for share in shares) + " |")


def paced_rows(tokens: int) -> None:
    """Rows whose drafts hold differently all along (4 rows: one at 30% per draft, three at 70-80%), every row
    priced by its pace, and a later cycle costing `share` whatever its rows plus the rest per row still generating:
    a first cycle simulated / priced, against the prices that ignore paces or costs."""
    acceptance = [[0.3] * 8] + [[0.7] + [0.8] * 7] * 3
    rooms, batch, ks = [tokens] * 4, torch.tensor(acceptance), (1, 2, 4)
    print(f"\n| 4 rows, one lagging: a first cycle | {' | '.join(f'k = {k}' for k in ks)} |")
    print("| --- |" + " ---: |" * len(ks))
    for share in (1.0, 0.6, 0.2):
        row, cost = [], lambda num_tokens, share=share: share
        for k in ks:
            simulated = first_cycle_worth(rooms, k, acceptance, share, trials=4000)
            priced = expected_tokens(batch, rooms, kept_paces(acceptance, k), cost)[k]
            pooled = expected_tokens(batch, rooms, None, cost)[k]
            row.append(f"{simulated:.2f} / {priced:.2f} ({pooled:.2f})")
        print(f"| share {share}: simulated / priced (without paces) | " + " | ".join(row) + " |")
    mean = expected_tokens(batch)
    print("| the rows' mean | " + " | ".join(f"{mean[k]:.2f}" for k in ks) + " |")


if __name__ == "__main__":
    main()
