"""Plain steps of the batched loop against transformers' batched generate(): drafting forced off.

Both paths run the same left-padded batch; the script counts the target's forwards and splits each call's wall time
into time inside the target's forward and the rest (the loop's host work). The first pair of calls is a warm-up, in
which our first call also measures the policy's verify-cost table (extra forwards). docs/benchmarks.md, "Batches",
quotes the pairs after it:

    python examples/batch_plain_steps.py --prompts humaneval --batch-size 8
"""

from __future__ import annotations

import argparse
import functools
import time

from hf_domino import assets, policy_domino
from hf_domino.measure_batch import generated_tokens, smollm2_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target, tokenizer, drafter, (batch,) = smollm2_batches(args.prompts, args.batch_size, args.batch_size)
    policy_domino.AdaptivePolicy.budget = lambda self, room: 0  # never draft: every cycle is a plain step
    eos = assets.eos_token_ids(target, tokenizer)

    forward = {"calls": 0, "seconds": 0.0}
    untimed = target.forward

    @functools.wraps(untimed)  # its signature: generate() passes logits_to_keep only to a forward that names it
    def timed(*positional, **keywords):
        start = time.perf_counter()
        output = untimed(*positional, **keywords)
        forward["seconds"] += time.perf_counter() - start
        forward["calls"] += 1
        return output

    target.forward = timed
    for method in ("target", "ours") * (args.repeats + 1):
        extra = {"assistant_model": drafter} if method == "ours" else {}
        forward.update(calls=0, seconds=0.0)
        start = time.perf_counter()
        output = target.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, **extra)
        wall = time.perf_counter() - start
        tokens = generated_tokens(output, batch["input_ids"].shape[1], eos)
        print(
            f"{method:6s} wall {wall:6.2f} s, {tokens} tokens, {forward['calls']} forwards, "
            f"in the forward {forward['seconds']:6.2f} s, the rest {wall - forward['seconds']:5.2f} s"
        )


if __name__ == "__main__":
    main()
