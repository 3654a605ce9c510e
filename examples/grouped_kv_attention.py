"""One layer's masked attention over grouped key/value heads, at SmolLM2's heads (9 query heads over 3 key/value
heads, head dim 64), three ways: transformers' `sdpa` (`repeat_kv`), torch's fused kernel reading the groups in place
(`enable_gqa`), and two matmuls per key/value head (`grouped_matmul_attention`). Median microseconds per shape (rows x
queries x keys), the way `sdpa_grouped_kv` takes for it, and how far the other two outputs are from `sdpa`'s.
docs/benchmarks.md ("Verification reads grouped key/value heads in place", "Batched verification's attention") quotes
it, and docs/usage.md its differences on older torch (`enable_gqa` bit for bit from torch 2.9 on):

    python examples/grouped_kv_attention.py --threads 2
    PIP_CONSTRAINT=/dev/null pip install -q --target /tmp/torch26 "torch==2.6.*"   # PyPI's CUDA build, runs on a CPU
    PYTHONPATH=/tmp/torch26 python examples/grouped_kv_attention.py --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from types import SimpleNamespace

import torch
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_domino import cpu_fast_path
from hf_domino.cpu_fast_path import grouped_matmul_attention, sdpa_grouped_kv_forward

SHAPES = [  # (rows, queries, keys): one sequence's verifications, then a batch's steps and verifications
    (1, 2, 304), (1, 4, 304), (1, 8, 304), (1, 4, 1000), (1, 17, 1000),
    (2, 2, 400), (4, 1, 400), (4, 2, 400), (4, 3, 400), (4, 2, 1200), (8, 1, 400), (8, 2, 400), (8, 5, 400),
]  # fmt: skip


def median_us(function, repeats: int) -> float:
    for _ in range(20):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def path_taken(module, query, key, value, mask) -> str:
    """Which of the three `sdpa_grouped_kv_forward` runs for these inputs."""
    taken = []
    matmul, fused = cpu_fast_path.grouped_matmul_attention, F.scaled_dot_product_attention
    cpu_fast_path.grouped_matmul_attention = lambda *args: taken.append("matmul") or matmul(*args)
    F.scaled_dot_product_attention = lambda *args, **kwargs: (
        taken.append("enable_gqa" if kwargs.get("enable_gqa") else "repeat_kv") or fused(*args, **kwargs)
    )
    try:
        sdpa_grouped_kv_forward(module, query, key, value, mask, scaling=0.125)
    finally:
        cpu_fast_path.grouped_matmul_attention, F.scaled_dot_product_attention = matmul, fused
    return taken[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    columns = "`repeat_kv` (sdpa) | `enable_gqa` | matmuls per key/value head | taken | max diff from sdpa: `enable_gqa`, matmuls"
    print(f"| rows x queries x keys | {columns} |")
    print("| ---: | ---: | ---: | ---: | --- | --- |")
    for rows, queries, keys in SHAPES:
        query = torch.randn(rows, 9, queries, 64)
        # The cache as the loops keep it: views of the first columns of larger buffers.
        key, value = (torch.randn(rows, 3, keys + 256, 64)[:, :, :keys] for _ in range(2))
        causal = torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None]
        mask = torch.stack([causal & (torch.arange(keys) >= 7 * row) for row in range(rows)])[:, None]  # left padding
        runs = {
            "sdpa": functools.partial(sdpa_attention_forward, module, query, key, value, mask, scaling=0.125),
            "enable_gqa": functools.partial(
                F.scaled_dot_product_attention, query, key, value, attn_mask=mask, scale=0.125, enable_gqa=True
            ),
            "matmul": functools.partial(grouped_matmul_attention, query, key, value, mask, 0.125),
        }
        reference = runs["sdpa"]()[0]
        diffs = {
            "enable_gqa": (runs["enable_gqa"]().transpose(1, 2) - reference).abs().max(),
            "matmul": (runs["matmul"]().transpose(1, 2) - reference).abs().max(),
        }
        timings = " | ".join(f"{median_us(run, args.repeats):.0f} us" for run in runs.values())
        taken = path_taken(module, query, key, value, mask)
        diff = ", ".join(f"{float(d):.0e}" if d else "0 (identical)" for d in diffs.values())
        print(f"| {rows} x {queries} x {keys} | {timings} | {taken} | {diff} |")


if __name__ == "__main__":
    main()
