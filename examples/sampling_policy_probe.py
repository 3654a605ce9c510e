"""The adaptive policy when sampling, one sequence at a time: per prompt its speed, its tokens per forward, how many
forwards drafted, verified drafts, or were plain steps (pauses), and at the end the acceptance it learned per draft
position and per confidence bin, its times and the verify-cost table. docs/benchmarks.md quotes it ("Trees priced by
the adaptive policy, and sampled"; "The adaptive policy when sampling", run each time in a fresh process):

    python examples/sampling_policy_probe.py                                   # the adaptive policy
    python examples/sampling_policy_probe.py --fixed 2                         # fixed k = 2
    python examples/sampling_policy_probe.py --peak-confidence                 # confidence = each draft's peak prob.
    python examples/sampling_policy_probe.py --alone                           # the target alone
    python examples/sampling_policy_probe.py --set SAMPLED_POSITION_RATE=0.2   # a policy_domino constant changed

The prepared SmolLM2 target and the shipped drafter on this CPU (the CPU fast path), the drafter's drafts only (no
copies, unless `--lookup`), prompt i sampled with seed `--seed` + i (`--repeats` passes, each with new seeds). `--peak-confidence`
replaces a drawn draft's probability by the largest probability of its distribution as the confidence the policy
calibrates (an experiment: the package does not do so).
"""

from __future__ import annotations

import argparse
import ast
import collections
import time

import torch

import hf_domino
from hf_domino import cost_model_domino, drafting_domino, policy_domino, records_domino
from hf_domino.assets import encode_chat, load_drafter, load_target
from hf_domino.prompt_sets import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="mtbench", help="mtbench, humaneval, ... (prompt_sets.load_prompts)")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts, each with new seeds")
    parser.add_argument("--quiet", action="store_true", help="no line per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--fixed", type=int, default=None, help="a fixed number of drafts instead of the adaptive policy"
    )
    parser.add_argument("--peak-confidence", action="store_true")
    parser.add_argument("--alone", action="store_true", help="the target alone, for the baseline")
    parser.add_argument("--lookup", action="store_true", help="copied drafts too (the default setting)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a policy_domino constant, e.g. POSITION_RATE=0.05",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    for assignment in args.set:
        name, value = assignment.split("=")
        setattr(policy_domino, name, ast.literal_eval(value))  # "False" is False, 0.05 a float
    if args.peak_confidence:
        drafting_domino.draft_confidence = lambda logits, index: logits.float().softmax(-1).amax(-1)[0]
    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter()
    hf_domino.prepare_for_cpu_decoding(target, drafter)
    sampling = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    policy = {} if args.fixed is None else dict(draft_policy="fixed", num_speculative_tokens=args.fixed)
    prompts = [encode_chat(tokenizer, messages) for messages in load_prompts(args.prompts, args.num_prompts)]
    target.generate(prompts[0], max_new_tokens=16, **sampling)  # warm-up
    total_tokens = total_seconds = 0.0
    passes = []
    for repeat in range(args.repeats):
        pass_tokens = pass_seconds = 0.0
        for index, prompt in enumerate(prompts):
            seed = args.seed + repeat * len(prompts) + index
            tokens, seconds = probe_prompt(target, drafter, prompt, seed, sampling, policy, args)
            pass_tokens, pass_seconds = pass_tokens + tokens, pass_seconds + seconds
        passes.append(pass_tokens / pass_seconds)
        total_tokens, total_seconds = total_tokens + pass_tokens, total_seconds + pass_seconds
    print(f"all prompts: {total_tokens / total_seconds:.1f} tokens/s; per pass {[round(rate, 1) for rate in passes]}")
    for mode, record in records_domino._RECORDS.get(drafter, {}).get(target, {}).items():
        if record.steady_cycles:
            calibration = (record.calibration.accepted / record.calibration.trials).tolist()
            print(f"{mode}: acceptance per position {[round(a, 2) for a in record.position_acceptance[:4]]}, "
                  f"per confidence bin {[round(a, 2) for a in calibration]}, "
                  f"drafts per bin {record.calibration.trials.int().tolist()}")  # fmt: skip
            print(f"  times (ms): backbone {1e3 * (record.backbone_seconds or 0):.1f}, "
                  f"per position {1e3 * (record.position_seconds or 0):.2f}, pause {record.skip_interval}")  # fmt: skip
    table = cost_model_domino.cached_verify_cost(target)
    if table is not None:
        print(f"verify cost (ms) by forward length: { {n: round(1e3 * s, 1) for n, s in table.seconds.items()} }")


def probe_prompt(target, drafter, prompt, seed, sampling, policy, args) -> tuple[int, float]:
    """One sampled generation; prints its line unless --quiet. Returns (new tokens, seconds)."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    if args.alone:
        output = target.generate(prompt, max_new_tokens=args.max_new_tokens, **sampling)
        return output.shape[1] - prompt.shape[1], time.perf_counter() - start
    output = target.generate(prompt, max_new_tokens=args.max_new_tokens, assistant_model=drafter,
                             domino_timings=True, domino_lookup=args.lookup, **sampling, **policy)  # fmt: skip
    seconds = time.perf_counter() - start
    stats, new = drafter.last_generation_stats, output.shape[1] - prompt.shape[1]
    drafting = len(stats.timings.get("backbone", []))
    verified = sum(1 for n in stats.drafted if n > 0)
    if not args.quiet:
        print(f"{new / seconds:5.1f} tokens/s, {stats.mean_acceptance_length:.2f} tokens per forward, "
              f"{len(stats.drafted)} forwards: {drafting} drafted ({drafting - verified} declined), "
              f"{len(stats.drafted) - drafting} plain steps; drafts verified {dict(collections.Counter(stats.drafted))}")  # fmt: skip
    return new, seconds


if __name__ == "__main__":
    main()
