"""Which CPU fast path for decoding: oneDNN-prepacked weights or torch.compile with weight freezing, end to end.

Issue 21 asked for torch.compile (inductor, `freezing=True`, dynamic shapes) wherever it measures better than
`hf_domino.prepare_for_cpu_decoding` with decoding's changing lengths. This runs both through `generate()` on the
offline SmolLM2 target, alone and with the shipped drafter, and prints tokens/s, the time compiling took, and whether
the outputs are identical. The compiled target is a copy of its own (inductor packs the dense weights itself); the
drafter is prepared in both runs.

    python examples/cpu_compile_vs_prepacked.py [--threads 2] [--num-prompts 3] [--max-new-tokens 64]

Compiling takes minutes on 2 cores; the first prompt warms both paths up and is not timed.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._inductor.config as inductor_config

from hf_domino import assets, prepare_for_cpu_decoding, prompt_sets


def generate(target, drafter, input_ids: torch.LongTensor, max_new_tokens: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    output = target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        assistant_model=drafter,
    )
    return time.perf_counter() - start, output[0, input_ids.shape[1] :]


def timed_runs(label: str, target, drafter, prompts, max_new_tokens: int) -> dict[str, list[torch.Tensor]]:
    """tokens/s of the target alone and with the drafter over `prompts[1:]`, after `prompts[0]` warmed both up."""
    start = time.perf_counter()
    for with_drafter in (None, drafter):
        generate(target, with_drafter, prompts[0], 16)
    print(f"{label}: warm-up (compiling, if any) {time.perf_counter() - start:.0f} s", flush=True)
    outputs = {}
    for name, with_drafter in (("target", None), ("domino", drafter)):
        runs = [generate(target, with_drafter, input_ids, max_new_tokens) for input_ids in prompts[1:]]
        tokens, seconds = sum(len(out) for _, out in runs), sum(s for s, _ in runs)
        print(f"{label}, {name}: {tokens / seconds:.1f} tokens/s", flush=True)
        outputs[name] = [out for _, out in runs]
    return outputs


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=3, help="MT-Bench prompts; the first only warms up")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = assets.load_target("smollm2", device="cpu")
    drafter = assets.load_drafter()
    prompts = [assets.encode_chat(tokenizer, m) for m in prompt_sets.load_prompts("mtbench", args.num_prompts)]

    prepare_for_cpu_decoding(target, drafter)
    prepacked = timed_runs("prepacked", target, drafter, prompts, args.max_new_tokens)

    inductor_config.freezing = True
    compiled, _ = assets.load_target("smollm2", device="cpu")
    compiled.forward = torch.compile(compiled.forward, dynamic=True)
    timed_runs("compiled", compiled, drafter, prompts, args.max_new_tokens)
    again = timed_runs("compiled, again", compiled, drafter, prompts, args.max_new_tokens)
    for name in ("target", "domino"):
        same = all(torch.equal(a, b) for a, b in zip(prepacked[name], again[name]))
        print(f"{name}: compiled output identical to prepacked: {same}")


if __name__ == "__main__":
    main()
