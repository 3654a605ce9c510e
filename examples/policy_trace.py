"""The adaptive policy cycle by cycle on real batches: each block's budget, the drafts verified and accepted per
row, and the cycle's predicted and measured cost against a plain step. docs/benchmarks.md, "Batches", quotes it:

    python examples/policy_trace.py --prompts mtbench --batch-size 2
"""

from __future__ import annotations

import argparse
import inspect
import time

from hf_domino import policy_domino
from hf_domino.measure_batch import smollm2_batches


def traced(policy_class, log: list[str]) -> None:
    """Wraps `budget` and `observe` of the policy class so that every decision is logged."""
    budget, observe = policy_class.budget, policy_class.observe

    def logged_budget(self, room):
        k = budget(self, room)
        rate = self.record.drafting_rate
        drafting = "unmeasured" if rate is None else f"{rate:.1f} tok/s"
        log.append(f"  budget {k} (plain {1 / self.verify_cost(1):.1f} tok/s, drafting {drafting})")
        return k

    def logged_observe(self, **cycle):
        if cycle.get("drafted"):
            predicted = self.cycle_seconds(cycle["positions"], cycle["verified"])
            parts = [cycle["backbone_seconds"], cycle["rollout_seconds"], cycle["verify_seconds"]]
            log.append(
                f"  cycle: verified {cycle['verified']}, accepted {cycle['accepted']}; predicted "
                f"{predicted * 1e3:.0f} ms, measured {sum(parts) * 1e3:.0f} ms (backbone {parts[0] * 1e3:.0f}, "
                f"rollout {parts[1] * 1e3:.0f}, verify {parts[2] * 1e3:.0f}); plain step {self.verify_cost(1) * 1e3:.0f} ms"
            )
        else:
            log.append(f"  plain step {cycle['verify_seconds'] * 1e3:.0f} ms")
        return observe(self, **cycle)

    policy_class.budget, policy_class.observe = logged_budget, logged_observe


def traced_copies(log: list[str]) -> None:
    """Wraps `LookupPolicy.choose` so that every row's copies found (c: from its text, r: retrieved from the
    datastore) and the width verified are logged."""
    choose, observe = policy_domino.LookupPolicy.choose, policy_domino.LookupPolicy.observe
    text_policy: list = []

    def logged_choose(self, num_found, *args, **kwargs):
        text_policy[:] = [self]  # the batch loop asks the text's policy; a row's source may be the datastore's
        # Read by name, whatever else `choose` takes (it gained `rooms`, then `paces`).
        arguments = inspect.signature(choose).bind(self, num_found, *args, **kwargs)
        arguments.apply_defaults()
        rival_rate, sources = arguments.arguments["rival_rate"], arguments.arguments["sources"]
        width = choose(self, num_found, *args, **kwargs)
        kinds = (
            ""
            if sources is None
            else " from " + "".join("-" if n == 0 else "c" if s is self else "r" for n, s in zip(num_found, sources))
        )
        log.append(f"  copies found {num_found}{kinds} -> verify {width} (rival {rival_rate:.1f} tok/s)")
        return width

    def logged_observe(self, **outcome):
        kind = "copies" if self in text_policy else "retrieved"
        log.append(f"    {kind}: {outcome['accepted']} of {outcome['verified']} right")
        return observe(self, **outcome)

    policy_domino.LookupPolicy.choose, policy_domino.LookupPolicy.observe = logged_choose, logged_observe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    target, tokenizer, drafter, groups = smollm2_batches(args.prompts, args.num_prompts, args.batch_size)
    log: list[str] = []
    traced(policy_domino.AdaptivePolicy, log)
    traced_copies(log)

    def seconds(batch, tokens: int, **extra) -> float:
        start = time.perf_counter()
        target.generate(**batch, max_new_tokens=tokens, do_sample=False, **extra)
        return time.perf_counter() - start

    for extra in ({}, {"assistant_model": drafter}):  # warm-up
        seconds(groups[0], 16, **extra)
    for number, batch in enumerate(groups):
        alone = seconds(batch, args.max_new_tokens)
        log.clear()
        drafting = seconds(batch, args.max_new_tokens, assistant_model=drafter)
        print(
            f"group {number}: target alone {alone:.2f} s, with the drafter {drafting:.2f} s ({alone / drafting:.2f}x)"
        )
        print("\n".join(log))


if __name__ == "__main__":
    main()
