"""Micro-benchmark of one Domino head rollout (a 16-draft block) at Qwen3-8B shapes: eager vs fused vs fused + graph.

Times only the sequential head (`DominoForSpeculation.rollout` and its fused replacements), from backbone outputs
and base logits to the drafted tokens, with random bf16 weights: hidden 4096, GRU 1024, rank 256, vocab 151936.
Prints a markdown table of the median latency per block.

    python examples/head_microbench.py                       # greedy
    python examples/head_microbench.py --temperature 1.0     # sampling (Gumbel-max in the fused kernels)

Needs a CUDA GPU and Triton; on CPU it says so and exits (the eager path at these shapes is not a useful CPU number).
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time

import torch
from torch import nn

from hf_domino import DominoConfig, DominoForSpeculation, TargetModules
from hf_domino.generation_domino import DominoCandidateGenerator

QWEN3_8B = {"hidden_size": 4096, "gru_hidden_dim": 1024, "emb_dim": 256, "vocab_size": 151936}


def build_head(args: argparse.Namespace, device: torch.device) -> tuple[DominoForSpeculation, nn.Embedding]:
    # A one-layer, one-head backbone: only the head is timed, so the backbone is kept as small as the config allows.
    config = DominoConfig(
        hidden_size=args.hidden_size,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=128,
        vocab_size=args.vocab_size,
        num_target_layers=36,
        target_layer_ids=[1],
        mask_token_id=0,
        projector_type="domino",
        emb_dim=args.emb_dim,
        gru_hidden_dim=args.gru_hidden_dim,
        block_size=args.num_drafts,
        shift_label=True,
    )
    with torch.device(device):
        drafter = DominoForSpeculation(config).to(torch.bfloat16).eval()
        embed = nn.Embedding(args.vocab_size, args.hidden_size, dtype=torch.bfloat16)
    return drafter, embed


def eager_picker(temperature: float | None):
    """The generator's own picker with a temperature-only processor list: exactly what `_draft` runs eagerly.

    Borrowing `_pick` (on a bare instance holding the two attributes it reads) times the real eager path rather than
    a copy of it; if the generator changes shape, this is the one place to update.
    """
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    generator = object.__new__(DominoCandidateGenerator)
    generator.do_sample = temperature is not None
    processors = [] if temperature in (None, 1.0) else [TemperatureLogitsWarper(temperature)]
    generator.logits_processor = LogitsProcessorList(processors) if processors else None
    return generator._pick


def median_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-drafts", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default greedy)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=100)
    for name, value in QWEN3_8B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("head_microbench.py measures GPU kernels and needs a CUDA device; none is available here.")
        sys.exit(0)
    import triton

    from hf_domino import triton_head

    torch.manual_seed(0)
    device = torch.device("cuda")
    drafter, embed = build_head(args, device)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    draft_hidden = torch.randn(1, args.num_drafts, args.hidden_size, device=device, dtype=torch.bfloat16)
    base_logits = torch.randn(1, args.num_drafts, args.vocab_size, device=device) * 4
    anchor_ids = torch.tensor([[42]], device=device)
    pick = eager_picker(args.temperature)
    prefix_len = drafter.config.pure_draft_prefix_len
    runner = triton_head.DominoHeadGraphRunner(drafter, temperature=args.temperature)

    paths = {
        "eager (`drafter.rollout`)": lambda: drafter.rollout(draft_hidden, base_logits, anchor_ids, target, pick),
        "fused Triton": lambda: triton_head.fused_rollout(
            drafter,
            draft_hidden,
            base_logits,
            anchor_ids,
            embed.weight,
            pure_draft_prefix_len=prefix_len,
            temperature=args.temperature,
        ),
        "fused Triton + CUDA graph": lambda: runner(draft_hidden, base_logits, anchor_ids, embed.weight),
    }
    with torch.no_grad():
        results = {name: median_ms(fn, args.warmup, args.reps) for name, fn in paths.items()}
        if args.temperature is None:  # the three paths must agree before their timings mean anything
            reference = paths["eager (`drafter.rollout`)"]()[0]
            agreement = {name: float((fn()[0] == reference).float().mean()) for name, fn in paths.items()}
        else:
            agreement = dict.fromkeys(paths)  # sampled drafts are random: nothing to compare

    eager = results["eager (`drafter.rollout`)"]
    print(
        f"Device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; triton {triton.__version__}; "
        f"Python {platform.python_version()}"
    )
    print(
        f"Shapes: hidden {args.hidden_size}, GRU {args.gru_hidden_dim}, rank {args.emb_dim}, vocab {args.vocab_size}, "
        f"{args.num_drafts} drafts, bf16 weights, {'greedy' if args.temperature is None else f'T={args.temperature}'}"
    )
    print(f"Command: `python {shlex.join(sys.argv)}` (median of {args.reps} blocks after {args.warmup} warm-up)\n")
    print("| path | ms / block | speedup vs eager | drafts equal to eager |")
    print("|---|---:|---:|---:|")
    for name, ms in results.items():
        equal = "n/a (sampling)" if agreement[name] is None else f"{agreement[name]:.0%}"
        print(f"| {name} | {ms:.3f} | {eager / ms:.2f}x | {equal} |")


if __name__ == "__main__":
    main()
