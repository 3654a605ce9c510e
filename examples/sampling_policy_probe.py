"""The adaptive policy when sampling, one sequence at a time: per prompt its speed, its tokens per forward, how many
forwards drafted, verified drafts, or were plain steps (pauses), and at the end the acceptance it learned per draft
position and per confidence bin. docs/benchmarks.md, "Trees priced by the adaptive policy, and sampled", quotes it:

    python examples/sampling_policy_probe.py                                   # the adaptive policy
    python examples/sampling_policy_probe.py --fixed 2                         # fixed k = 2
    python examples/sampling_policy_probe.py --peak-confidence                 # confidence = each draft's peak prob.

The prepared SmolLM2 target and the shipped drafter on this CPU (the CPU fast path), the drafter's drafts only (no
copies), seeds 0, 1, ... per prompt. `--peak-confidence` replaces a drawn draft's probability by the largest
probability of its distribution as the confidence the policy calibrates (an experiment: the package does not do so).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import hf_domino
from hf_domino import drafting_domino, policy_domino
from hf_domino.assets import encode_chat, load_drafter, load_mtbench, load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--fixed", type=int, default=None, help="a fixed number of drafts instead of the adaptive policy"
    )
    parser.add_argument("--peak-confidence", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.peak_confidence:
        drafting_domino.draft_confidence = lambda logits, index: logits.float().softmax(-1).amax(-1)[0]
    target, tokenizer = load_target("smollm2")
    drafter = load_drafter()
    hf_domino.prepare_for_cpu_decoding(target, drafter)
    sampling = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    policy = {} if args.fixed is None else dict(draft_policy="fixed", num_speculative_tokens=args.fixed)
    target.generate(encode_chat(tokenizer, load_mtbench(1)[0]), max_new_tokens=16, **sampling)  # warm-up
    total_tokens = total_seconds = 0.0
    for seed, messages in enumerate(load_mtbench(args.num_prompts)):
        prompt = encode_chat(tokenizer, messages)
        torch.manual_seed(seed)
        start = time.perf_counter()
        output = target.generate(prompt, max_new_tokens=args.max_new_tokens, assistant_model=drafter,
                                 domino_timings=True, domino_lookup=False, **sampling, **policy)  # fmt: skip
        seconds = time.perf_counter() - start
        stats, new = drafter.last_generation_stats, output.shape[1] - prompt.shape[1]
        total_tokens, total_seconds = total_tokens + new, total_seconds + seconds
        drafting = len(stats.timings.get("backbone", []))
        verified = sum(1 for n in stats.drafted if n > 0)
        print(f"{new / seconds:5.1f} tokens/s, {stats.mean_acceptance_length:.2f} tokens per forward, "
              f"{len(stats.drafted)} forwards: {drafting} drafted ({drafting - verified} declined), "
              f"{len(stats.drafted) - drafting} plain steps; drafts verified {dict(collections.Counter(stats.drafted))}")  # fmt: skip
    print(f"all prompts: {total_tokens / total_seconds:.1f} tokens/s")
    for mode, record in policy_domino._RECORDS[drafter].items():
        if record.steady_cycles:
            calibration = (record.calibration.accepted / record.calibration.trials).tolist()
            print(f"{mode}: acceptance per position {[round(a, 2) for a in record.position_acceptance[:4]]}, "
                  f"per confidence bin {[round(a, 2) for a in calibration]}, "
                  f"drafts per bin {record.calibration.trials.int().tolist()}")  # fmt: skip


if __name__ == "__main__":
    main()
