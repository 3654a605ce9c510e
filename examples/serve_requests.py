"""Many requests, B rows at a time: requests joining the drafted batch as rows finish (`generate_batch` with the
drafter) against fixed batches of B (`generate()`, with and without the drafter) and transformers' own continuous
batching of the target alone, in one process on the SmolLM2 target and the shipped drafter (on a CPU, its fast path;
on a GPU where one is found, unless `--device cpu`).

A fixed batch ends with its last row, so its last cycles run with few rows; a refilled one stays full while requests
wait. Each method runs the whole prompt list once per repeat, in an order that alternates between repeats, after a
warm-up call; tokens are each request's own (to its EOS), and the rates are total tokens over total seconds, so one
slow request weighs what it costs. Every answer with the drafter is asserted identical to the target alone's for
that prompt. docs/benchmarks.md quotes it:

    python examples/serve_requests.py --prompts mtbench --num-prompts 24 --rows 4 --repeats 2
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from hf_domino import prepare_for_cpu_decoding
from hf_domino.assets import chat_token_ids, eos_token_ids, load_drafter, load_target, pad_token_id
from hf_domino.measure_batch import left_padded_groups, paged_cache_for, row_lengths
from hf_domino.prompt_sets import load_prompts


def in_batches(target, tokenizer, prompts, rows, max_new_tokens, **extra) -> list[list[int]]:
    """Fixed batches of `rows` prompts through generate(): each row's tokens up to its EOS (`row_lengths`)."""
    pad, eos, answers = pad_token_id(target, tokenizer), eos_token_ids(target, tokenizer), []
    for batch in left_padded_groups(tokenizer, prompts, rows, pad):
        output = target.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **extra)
        width = batch["input_ids"].shape[1]
        answers += [row[width : width + n].tolist() for row, n in zip(output, row_lengths(output, width, eos))]
    return answers


def served(target, prompts, rows, max_new_tokens, config, **extra) -> list[list[int]]:
    """generate_batch: requests joining as rows finish. transformers' own takes the target's plain `sdpa` (it refuses
    the fast path's attention, and switches to its paged one), then the prepared attention is put back."""
    prepared = target.config._attn_implementation
    if "assistant_model" not in extra:
        target.set_attn_implementation("sdpa")
    try:
        results = target.generate_batch(
            prompts, continuous_batching_config=config, max_new_tokens=max_new_tokens, do_sample=False, **extra
        )
    finally:
        target.set_attn_implementation(prepared)
    return [result.generated_tokens for result in results.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device=args.device)
    drafter = load_drafter(None).to(target.device, target.dtype)
    print(prepare_for_cpu_decoding(target, drafter, batch_size=args.rows))
    # What the adaptive policy learns (rates, pauses, whether a batch size's calls pay) is kept per drafter object: a
    # copy per method, so that neither method's calls start from what the other's taught it.
    fixed, joining = drafter, copy.deepcopy(drafter)
    prompts = [chat_token_ids(tokenizer, messages) for messages in load_prompts(args.prompts, args.num_prompts)]
    prompts = prompts[: len(prompts) - len(prompts) % args.rows]  # whole fixed batches
    rows, new = args.rows, args.max_new_tokens
    pages = paged_cache_for(prompts, rows, new)
    methods = {
        "target, fixed batches": lambda: in_batches(target, tokenizer, prompts, rows, new),
        "target, generate_batch (transformers)": lambda: served(target, prompts, rows, new, pages),
        "drafter, fixed batches": lambda: in_batches(target, tokenizer, prompts, rows, new, assistant_model=fixed),
        "drafter, generate_batch (joining)": lambda: served(
            target, prompts, rows, new, pages, assistant_model=joining
        ),
    }
    eos = eos_token_ids(target, tokenizer)
    reference = []
    for prompt in prompts:
        output = target.generate(torch.tensor([prompt], device=target.device), max_new_tokens=new, do_sample=False)
        reference.append(output[0, len(prompt) : len(prompt) + row_lengths(output, len(prompt), eos)[0]].tolist())
    differing = {}
    for name, run in methods.items():  # warm-up, and every method's answers checked once
        answers = run()
        differing[name] = sum(answer != alone for answer, alone in zip(answers, reference))
        # Exact on a CPU (fp32); a GPU's kernels differ with the batch's shape, and so may its batches' answers,
        # the target's own included: there they are counted.
        if name.startswith("drafter") and target.device.type == "cpu":
            assert answers == reference, f"{name}: an answer differs from the target alone's"
    seconds = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    for repeat in range(args.repeats):
        for name in list(methods) if repeat % 2 == 0 else list(reversed(methods)):
            start = time.perf_counter()
            answers = methods[name]()
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(map(len, answers))
    base = tokens["target, fixed batches"] / seconds["target, fixed batches"]
    print(f"{args.prompts}: {len(prompts)} requests, {rows} rows at a time, {new} new tokens, greedy, "
          f"{args.repeats} repeats, {args.threads} threads, {target.device}, {target.dtype}")  # fmt: skip
    for name in methods:
        rate = tokens[name] / seconds[name]
        print(f"  {name:40s} {rate:7.1f} tokens/s  {rate / base:.2f}x the target in fixed batches, "
              f"{differing[name]} of {len(prompts)} answers differing from the target alone's")  # fmt: skip


if __name__ == "__main__":
    main()
