"""Sampled decoding with and without the sort-free top-p (`warpers_domino.SortFreeTopP`), interleaved per prompt.

For each prompt, in one process and in turn: the target alone (transformers' own warpers), `generate()` with the
drafter as it runs (its top-p sort-free), and the same with transformers' `TopPLogitsWarper` kept (the generate()
hook's swap switched off), each with the prompt's seed. Prints each method's tokens per second over all prompts and
the median per-prompt time ratio against the target alone. The prepared SmolLM2 target and the shipped drafter
(`prepare_for_cpu_decoding`), 2 threads. With `--fixed K` (fixed blocks, so no timing decides anything) the two
drafted runs must draw the same tokens, which it checks. docs/benchmarks.md quotes it ("A sort-free top-p"):

    python examples/top_p_probe.py --num-prompts 10
    python examples/top_p_probe.py --num-prompts 4 --fixed 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_domino
from hf_domino import generate_hook_domino
from hf_domino.assets import encode_chat, load_drafter, load_target
from hf_domino.prompt_sets import load_prompts

METHODS = ("target alone", "drafter, transformers' top-p", "drafter, sort-free top-p")


def timed(target, prompt: torch.LongTensor, seed: int, **options) -> tuple[torch.Tensor, float]:
    torch.manual_seed(seed)
    start = time.perf_counter()
    output = target.generate(prompt, **options)
    return output[0, prompt.shape[1] :], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="mtbench", help="mtbench, humaneval, ... (prompt_sets.load_prompts)")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--fixed", type=int, default=None, help="fixed blocks of K drafts (default: adaptive)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter()
    hf_domino.prepare_for_cpu_decoding(target, drafter)
    sampling = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=args.max_new_tokens)
    policy = {} if args.fixed is None else {"draft_policy": "fixed", "num_speculative_tokens": args.fixed}
    sort_free = generate_hook_domino.sort_free_top_p
    prompts = load_prompts(args.prompts, args.num_prompts)
    timed(target, encode_chat(tokenizer, prompts[0]), 0, assistant_model=drafter, **sampling)  # warm-up
    tokens, seconds, ratios = dict.fromkeys(METHODS, 0), dict.fromkeys(METHODS, 0.0), {m: [] for m in METHODS[1:]}
    for i, messages in enumerate(prompts):
        prompt, seed = encode_chat(tokenizer, messages), args.seed + i
        runs = {METHODS[0]: timed(target, prompt, seed, **sampling)}
        generate_hook_domino.sort_free_top_p = lambda processors: None
        try:
            runs[METHODS[1]] = timed(target, prompt, seed, assistant_model=drafter, **sampling, **policy)
        finally:
            generate_hook_domino.sort_free_top_p = sort_free
        runs[METHODS[2]] = timed(target, prompt, seed, assistant_model=drafter, **sampling, **policy)
        if args.fixed is not None and not torch.equal(runs[METHODS[1]][0], runs[METHODS[2]][0]):
            raise SystemExit(f"prompt {i}: the two drafted runs drew different tokens")
        for method, (output, elapsed) in runs.items():
            tokens[method] += output.shape[0]
            seconds[method] += elapsed
        alone, alone_seconds = runs[METHODS[0]]
        for method in METHODS[1:]:
            output, elapsed = runs[method]
            ratios[method].append((alone_seconds / alone.shape[0]) / (elapsed / output.shape[0]))
    print(f"{args.num_prompts} {args.prompts} prompts x {args.max_new_tokens} tokens, T 0.6, top-k 20, top-p 0.95, "
          f"{'adaptive' if args.fixed is None else f'fixed k = {args.fixed}'}")  # fmt: skip
    print("| method | tokens/s | median speed ratio vs the target alone (per prompt, time per token) |")
    print("| --- | ---: | ---: |")
    for method in METHODS:
        ratio = "1.00x" if method == METHODS[0] else f"{statistics.median(ratios[method]):.2f}x"
        print(f"| {method} | {tokens[method] / seconds[method]:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
