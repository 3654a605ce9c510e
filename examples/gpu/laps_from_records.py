"""Per-call laps from a `hf-domino bench` record: the figures docs/benchmarks.md, "The bf16 slow state", reads.

For the target alone, ms per generated token per call. For each drafting method and call: how many `backbone` laps
took over 20 ms, the cycle at which the first one did, the range of the laps before it, and after it the range over
whole blocks and over shorter ones (blocks cut by `max_new_tokens`, or chosen shorter: new query lengths).

    python examples/gpu/laps_from_records.py docs/gpu-runs/2026-11-27-h200/bfloat16-mtbench.json
    python examples/gpu/laps_from_records.py docs/gpu-runs/2026-11-26-h200/bfloat16-mtbench.json
"""

from __future__ import annotations

import argparse
import json

SLOW_S = 0.020  # a backbone lap over this waited for something besides the drafter's own 3-5 ms


def span(laps: list[float]) -> str:
    return f"{1000 * min(laps):.1f}-{1000 * max(laps):.1f}" if laps else "-"


def describe(method: str, call: int, record: dict) -> str:
    if record.get("drafted") is None:  # the target alone (or transformers' prompt lookup)
        return f"| {method} | {call} | {1000 * record['seconds'] / len(record['new_tokens']):.1f} | | | | | |"
    laps = (record.get("timings") or {}).get("backbone", [])
    copied = record.get("copied") or [False] * len(record["drafted"])
    # the cycles where the drafter ran (not a plain step, not copied drafts), in the order their laps were taken
    drafts = [k for k, was_copied in zip(record["drafted"], copied) if k > 0 and not was_copied]
    assert len(drafts) == len(laps), (method, call, len(drafts), len(laps))
    first = next((i for i, lap in enumerate(laps) if lap > SLOW_S), len(laps))
    whole = max(drafts, default=0)
    later = list(zip(laps[first:], drafts[first:]))
    return (
        f"| {method} | {call} | | {sum(lap > SLOW_S for lap in laps)}/{len(laps)} | {first} | {span(laps[:first])} "
        f"| {span([lap for lap, k in later if k == whole])} | {span([lap for lap, k in later if k < whole])} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", help="a bench.json")
    records = json.load(open(parser.parse_args().record))["records"]
    print(
        "| method | call | ms / token (target alone) | backbone laps > 20 ms | first such cycle | laps before it, ms "
        "| after it, whole blocks | after it, shorter blocks |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for method, calls in records.items():
        for call, record in enumerate(calls):
            print(describe(method, call, record))


if __name__ == "__main__":
    main()
