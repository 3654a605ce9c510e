"""Is bf16 regeneration faster on this CPU, and are its greedy answers still the target's own?

The target the drafter serves is SmolLM2-135M-Instruct de-quantized to fp32; bf16 rounds its weights and activations,
so greedy answers can drift from the fp32 ones, and a drafter trained on drifted answers learns another model. This
answers the first prompts of the training mix with `hf-domino regenerate`'s own code, once in fp32 and once in bf16
(one batch each, after a short warm-up), and prints the response tokens per second of each, how many answers are
token-identical, and how far the others agree (common prefix, as a share of the fp32 answer).

    python examples/regen_dtype_check.py [--num-prompts 16] [--max-new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hf_domino import assets, prompt_mix
from hf_domino.training import regenerate


def answers(dtype: str, ids: list[str], prompts: list, args: argparse.Namespace, folder: Path) -> tuple[dict, float]:
    """`{id: response ids}` and the response tokens per second of one batched regeneration in `dtype`."""
    model, tokenizer = assets.load_target("smollm2", dtype=regenerate.DTYPES[dtype], device="cpu")
    common = {"max_prompt_tokens": args.max_prompt_tokens, "progress": False}
    regenerate.regenerate(model, tokenizer, prompts[:2], folder / f"warmup_{dtype}.jsonl", max_new_tokens=4, **common)
    output = folder / f"{dtype}.jsonl"
    start = time.perf_counter()
    regenerate.regenerate(
        model,
        tokenizer,
        prompts,
        output,
        indices=ids,
        batch_size=len(prompts),
        max_new_tokens=args.max_new_tokens,
        **common,
    )
    seconds = time.perf_counter() - start
    responses = {}
    for line in output.read_text().splitlines():
        record = json.loads(line)
        responses[record["id"]] = [t for t, m in zip(record["input_ids"], record["loss_mask"]) if m]
    return responses, sum(map(len, responses.values())) / seconds


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ids, prompts = prompt_mix.training_prompt_mix("train", limit=args.num_prompts)
    with tempfile.TemporaryDirectory() as folder:
        fp32, fp32_rate = answers("float32", ids, prompts, args, Path(folder))
        bf16, bf16_rate = answers("bfloat16", ids, prompts, args, Path(folder))
    same = sum(fp32[key] == bf16[key] for key in ids)
    shares = [common_prefix(fp32[key], bf16[key]) / max(len(fp32[key]), 1) for key in ids]
    print(
        f"{len(ids)} prompts of the training mix, batch {len(ids)}, {args.max_new_tokens} new tokens, "
        f"{args.threads} threads"
    )
    print(f"fp32: {fp32_rate:.1f} response tokens/s; bf16: {bf16_rate:.1f} ({bf16_rate / fp32_rate:.2f}x)")
    print(
        f"bf16 answers identical to fp32: {same}/{len(ids)}; common prefix {100 * sum(shares) / len(ids):.0f}% of "
        f"the fp32 answer on average (min {100 * min(shares):.0f}%)"
    )


if __name__ == "__main__":
    main()
