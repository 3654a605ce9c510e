"""Where the time of `generate()` goes, with the drafter and without: target forwards timed by how many tokens they
take, and the work outside them per forward (the drafter, the copy and datastore lookups, the loop itself).
docs/benchmarks.md, "Verification reads grouped key/value heads in place", quotes it:

    python examples/cycle_time_split.py --prompts mtbench --num-prompts 6
    python examples/cycle_time_split.py --prompts mtbench --num-prompts 6 --attention sdpa  # as before the change
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from hf_domino import copied_drafts_domino, generation_domino, prepare_for_cpu_decoding
from hf_domino.assets import encode_chat, load_drafter, load_target
from hf_domino.prompt_sets import load_prompts


def timed_calls(owner, name: str, seconds: dict, calls: collections.Counter, key=None) -> None:
    """Wraps `owner.name` so that each call adds its wall time to `seconds[key(args) or name]`."""
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        label = name if key is None else key(args, kwargs)
        seconds[label] += time.perf_counter() - start
        calls[label] += 1
        return result

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--attention", default=None, help="the target's attention implementation (default: prepared)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter(None)
    prepare_for_cpu_decoding(target, drafter)
    if args.attention:
        target.set_attn_implementation(args.attention)
    drafter.datastore.build_index()
    prompts = [encode_chat(tokenizer, messages) for messages in load_prompts(args.prompts, args.num_prompts)]
    seconds, calls = collections.defaultdict(float), collections.Counter()
    timed_calls(type(target), "forward", seconds, calls, key=lambda a, k: k["input_ids"].shape[1])
    generator = generation_domino.DominoCandidateGenerator
    timed_calls(generator, "_draft", seconds, calls)
    timed_calls(generation_domino, "lookup_drafts", seconds, calls)
    timed_calls(copied_drafts_domino.DraftDatastore, "lookup", seconds, calls)
    for extra in ({}, {"assistant_model": drafter}):  # warm-up
        target.generate(prompts[0], max_new_tokens=16, do_sample=False, **extra)
    for name, extra in (("target alone", {}), ("with the drafter", {"assistant_model": drafter})):
        seconds.clear()
        calls.clear()
        start = time.perf_counter()
        for prompt in prompts:
            target.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False, **extra)
        wall = time.perf_counter() - start
        widths = sorted(key for key in calls if isinstance(key, int) and key < 40)  # decoding, not the prefills
        forward_seconds = sum(seconds[key] for key in calls if isinstance(key, int))
        forwards = sum(calls[key] for key in widths)
        print(f"{name}: {wall:.2f} s, {forwards} decoding forwards")
        print("  ms per forward by tokens: " + ", ".join(f"{w}: {seconds[w] / calls[w] * 1e3:.1f}" for w in widths))
        print(f"  outside the target's forward: {(wall - forward_seconds) / forwards * 1e3:.2f} ms per forward")
        for label in ("_draft", "lookup_drafts", "lookup"):
            if calls[label]:
                print(f"  {label}: {seconds[label] / calls[label] * 1e3:.2f} ms x {calls[label]}")


if __name__ == "__main__":
    main()
