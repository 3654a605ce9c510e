"""An A/B of drafting settings in `generate()` itself: which datastore n-gram sizes, which attention for verification.

Each setting gets its own drafter object, so that each learns its own acceptance and verify-cost records (they are
kept per drafter), and the settings run interleaved prompt by prompt in one process, their order alternating,
against the prepared target alone on the same prompt. Greedy outputs are asserted identical to the target alone's.
A setting is `sizes=4,3,2` (the datastore's n-gram sizes) or `attention=sdpa` (the target's attention
implementation while it verifies). docs/benchmarks.md quotes it:

    python examples/generate_ab.py --prompts mtbench --settings sizes=4,3 sizes=4,3,2
    python examples/generate_ab.py --prompts mtbench --settings attention=sdpa attention=sdpa_grouped_kv
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from hf_domino import prepare_for_cpu_decoding
from hf_domino.assets import chat_token_ids, load_drafter, load_prompts, load_target
from hf_domino.drafting_domino import DATASTORE_FILE, DraftDatastore


def timed(target, input_ids: list[int], max_new_tokens: int, **extra) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    output = target.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False, **extra)
    return output, time.perf_counter() - start


@contextlib.contextmanager
def target_attention(target, implementation: str | None) -> Iterator[None]:
    """The target verifies with `implementation` inside the block (None: as prepared)."""
    prepared = target.config._attn_implementation
    if implementation is not None:
        target.set_attn_implementation(implementation)
    try:
        yield
    finally:
        target.set_attn_implementation(prepared)


def drafter_for(setting: str, target):
    """A drafter of its own for `setting`, and the target attention it verifies with."""
    key, _, value = setting.partition("=")
    drafter = load_drafter(None)
    attention = None
    if key == "sizes":
        sizes = tuple(int(size) for size in value.split(","))
        drafter.datastore = DraftDatastore.load(str(drafter.name_or_path) + "/" + DATASTORE_FILE, ngram_sizes=sizes)
    elif key == "attention":
        attention = value
    else:
        raise SystemExit(f"unknown setting {setting!r}: use sizes=4,3,2 or attention=sdpa")
    prepare_for_cpu_decoding(target, drafter)
    if drafter.datastore is not None:
        drafter.datastore.build_index()
    return drafter, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--settings", nargs="+", required=True, help="e.g. sizes=4,3 sizes=4,3,2")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2")
    settings = {setting: drafter_for(setting, target) for setting in args.settings}
    prompts = [chat_token_ids(tokenizer, messages) for messages in load_prompts(args.prompts, args.num_prompts)]
    timed(target, prompts[0][:50], 8)  # warm-up
    for drafter, attention in settings.values():
        with target_attention(target, attention):
            timed(target, prompts[0][:50], 8, assistant_model=drafter)
    seconds = {name: [] for name in ["target", *settings]}
    tau = {name: [] for name in settings}
    for index, input_ids in enumerate(prompts):
        reference, elapsed = timed(target, input_ids, args.max_new_tokens)
        seconds["target"].append(elapsed)
        for name in list(settings) if index % 2 == 0 else list(reversed(settings)):
            drafter, attention = settings[name]
            with target_attention(target, attention):
                output, elapsed = timed(target, input_ids, args.max_new_tokens, assistant_model=drafter)
            assert torch.equal(output, reference), f"{name}: output differs from the target alone's"
            seconds[name].append(elapsed)
            tau[name].append(statistics.fmean(drafter.last_generation_stats.acceptance_lengths))
    print(f"{args.prompts}: {len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, identical outputs")
    for name in settings:
        speedup = sum(seconds["target"]) / sum(seconds[name])
        print(f"  {name:28s} {speedup:.3f}x the target alone, tau {statistics.fmean(tau[name]):.2f}")


if __name__ == "__main__":
    main()
