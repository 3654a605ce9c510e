"""transformers' own DFlash path against ours, on the same drafter weights and the real SmolLM2 target.

transformers drafts DFlash-style by itself (`generate(..., assistant_model=model, speculation_type="dflash")` with a
`MuseGlimmerAssistantModel`); `hf_domino.to_transformers_dflash` converts a DFlash drafter to it. Both then draft
the same tokens at every cycle (asserted here, cycle by cycle), so their acceptance is the same and the time each
takes is what its implementation costs for the same work. The methods, interleaved per prompt in one process, order
alternating, each output asserted identical to the target alone's (greedy, fp32):

- `transformers_dflash`: transformers' candidate generator with the converted drafter;
- `ours_same_work`: our generator drafting what transformers drafts (a whole block every cycle, no copied drafts,
  the whole vocabulary);
- `ours_default`: our generator as a plain `generate()` call runs it (the adaptive policy, copied and retrieved
  drafts, the drafter's draft vocabulary where it has one).

No SmolLM2 drafter with `shift_label=False` (the only kind transformers' path reads correctly) has been trained, so
the drafter is the shipped drafter's backbone read as one (`--drafter` names another folder): its drafts are
mostly wrong, which makes this a comparison of costs, not of speedups a trained DFlash drafter would give.

    python examples/transformers_dflash_ab.py --prompts mtbench --num-prompts 10 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from hf_domino import to_transformers_dflash
from hf_domino.assets import backbone_as_dflash, chat_token_ids, load_drafter, load_target, package_versions
from hf_domino.generation_domino import DominoCandidateGenerator
from hf_domino.prompt_sets import load_prompts

METHODS = ("transformers_dflash", "ours_same_work", "ours_default")


def recorded_drafts(generator_class) -> list[list[int]]:
    """Every cycle's drafts proposed by `generator_class` from now on (its `get_candidates`, wrapped)."""
    drafts: list[list[int]] = []
    get_candidates = generator_class.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates = get_candidates(self, input_ids, *args, **kwargs)
        drafts.append(candidates[0][0, input_ids.shape[1] :].tolist())
        return candidates

    generator_class.get_candidates = recording
    return drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", help="a drafter folder (default: the shipped drafter's backbone)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter(args.drafter)
    if drafter.config.shift_label or drafter.config.has_domino_head:
        drafter = backbone_as_dflash(drafter)
    native = to_transformers_dflash(drafter)
    extra = {
        "transformers_dflash": {"assistant_model": native, "speculation_type": "dflash"},
        "ours_same_work": {
            "assistant_model": drafter,
            "draft_policy": "fixed",
            "domino_lookup": False,
            "draft_vocab": False,
        },
        "ours_default": {"assistant_model": drafter},
    }
    theirs, ours = recorded_drafts(DFlashTokenCandidateGenerator), recorded_drafts(DominoCandidateGenerator)
    prompts = [chat_token_ids(tokenizer, messages) for messages in load_prompts(args.prompts, args.num_prompts)]

    def run(prompt: list[int], method: str | None, max_new_tokens: int) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        output = target.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, **extra.get(method, {})
        )
        return output, time.perf_counter() - start

    for method in (None, *METHODS):  # warm-up
        run(prompts[0], method, 8)
    seconds = {name: [] for name in ("target", *METHODS)}
    tokens, forwards = [], {name: 0 for name in METHODS}
    for index, prompt in enumerate(prompts):
        reference, elapsed = run(prompt, None, args.max_new_tokens)
        seconds["target"].append(elapsed)
        tokens.append(reference.shape[1] - len(prompt))
        for method in METHODS if index % 2 == 0 else reversed(METHODS):
            theirs.clear(), ours.clear()
            output, elapsed = run(prompt, method, args.max_new_tokens)
            assert torch.equal(output, reference), f"{method}: output differs from the target alone's"
            seconds[method].append(elapsed)
            # Target forwards, the prefill's included: transformers' generator is asked for drafts before each.
            if method == "transformers_dflash":
                forwards[method] += len(theirs)
                native_drafts = [d for d in theirs if d]
            else:
                forwards[method] += len(drafter.last_generation_stats.acceptance_lengths) + 1
                if method == "ours_same_work":
                    same_work_drafts = [d for d in ours if d]
        # Ours drafts only what max_new_tokens can still keep: compare each cycle up to the shorter of the two.
        assert len(native_drafts) == len(same_work_drafts), "the two paths verified a different number of blocks"
        assert all(n[: len(o)] == o for n, o in zip(native_drafts, same_work_drafts)), "the two paths drafted apart"

    versions = package_versions("torch", "transformers")
    print(
        f"{args.prompts}: {len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, fp32, {args.threads} threads, "
        f"torch {versions['torch']}, transformers {versions['transformers']}; every output identical to the target "
        "alone's, transformers' and our same-work drafts identical at every cycle"
    )
    total = sum(tokens)
    print(f"  {'target':20s} {total / sum(seconds['target']):6.1f} tokens/s")
    for method in METHODS:
        ratios = [t / m for t, m in zip(seconds["target"], seconds[method])]
        print(
            f"  {method:20s} {total / sum(seconds[method]):6.1f} tokens/s, {total / forwards[method]:.2f} tokens per "
            f"target forward, median {statistics.median(ratios):.2f}x the target alone (per prompt)"
        )
    per_prompt = [o / n for o, n in zip(seconds["ours_same_work"], seconds["transformers_dflash"])]
    print(f"  ours_same_work / transformers_dflash time, median per prompt: {statistics.median(per_prompt):.3f}")


if __name__ == "__main__":
    main()
