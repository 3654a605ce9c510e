"""One layer's masked attention over grouped key/value heads, as transformers' `sdpa` runs it (`repeat_kv`) and as
`sdpa_grouped_kv` does (`enable_gqa`), at SmolLM2's heads (9 query heads over 3 key/value heads, head dim 64):
median microseconds and whether the outputs are identical. docs/benchmarks.md, "Verification reads grouped
key/value heads in place", quotes it:

    python examples/grouped_kv_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_domino.cpu_fast_path import sdpa_grouped_kv_forward


def median_us(function, repeats: int) -> float:
    for _ in range(20):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    print("| queries x keys | `repeat_kv` + mask (sdpa) | `enable_gqa` + mask | outputs |")
    print("| ---: | ---: | ---: | --- |")
    for queries, keys in [(2, 304), (4, 304), (8, 304), (4, 1000), (17, 1000)]:
        query = torch.randn(1, 9, queries, 64)
        key, value = torch.randn(1, 3, keys, 64), torch.randn(1, 3, keys, 64)
        mask = (torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None])[None, None]
        inputs = (module, query, key, value, mask)
        runs = {
            name: functools.partial(forward, *inputs, scaling=0.125)
            for name, forward in (("sdpa", sdpa_attention_forward), ("grouped", sdpa_grouped_kv_forward))
        }
        same = "identical" if torch.equal(runs["sdpa"]()[0], runs["grouped"]()[0]) else "DIFFERENT"
        timings = [f"{median_us(run, args.repeats):.0f} us" for run in runs.values()]
        print(f"| {queries} x {keys} | {timings[0]} | {timings[1]} | {same} |")


if __name__ == "__main__":
    main()
