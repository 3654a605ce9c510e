"""Micro-benchmark of one Domino head rollout (a 16-draft block) at Qwen3-8B shapes: eager vs fused vs fused + graph.

Times only the sequential head, i.e. one ladder `Rollout` from a `BlockDraft` (backbone outputs and base logits) to
`Drafts`: the eager reference (`eager_rollout`) and the two fused rollouts `hf_domino.fused_head.select_rollout`
returns for `domino_rollout="triton"` and `"triton+graph"`, with random bf16 weights: hidden 4096, GRU 1024, rank 256,
vocab 151936. All three are called exactly as the candidate generator calls them. Prints a markdown table of the
median latency per block.

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
from hf_domino.drafting_domino import BlockDraft, Pick, eager_rollout, greedy_pick, processed_pick

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


def logits_processor(temperature: float | None):
    """The processor list generate() builds for greedy or plain temperature sampling (`None` when empty)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    if temperature in (None, 1.0):  # transformers adds no warper for temperature 1
        return None
    return LogitsProcessorList([TemperatureLogitsWarper(temperature)])


def eager_pick(temperature: float | None, vocab_size: int) -> Pick:
    """The pick the candidate generator gives `eager_rollout` for this decoding mode (full vocabulary)."""
    if temperature is None:
        return greedy_pick
    return processed_pick(logits_processor(temperature), True, None, vocab_size)


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

    from hf_domino.fused_head import select_rollout

    torch.manual_seed(0)
    device = torch.device("cuda")
    drafter, embed = build_head(args, device)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    draft_hidden = torch.randn(1, args.num_drafts, args.hidden_size, device=device, dtype=torch.bfloat16)
    block = BlockDraft(draft_hidden, torch.randn(1, args.num_drafts, args.vocab_size, device=device) * 4)
    anchor_ids = torch.tensor([[42]], device=device)
    do_sample, processors = args.temperature is not None, logits_processor(args.temperature)

    eager_name = "eager (`eager_rollout`)"
    rollouts = {
        eager_name: eager_rollout(drafter, target, eager_pick(args.temperature, args.vocab_size)),
        "fused Triton": select_rollout(
            drafter, target, do_sample=do_sample, logits_processor=processors, mode="triton"
        ),
        "fused Triton + CUDA graph": select_rollout(
            drafter, target, do_sample=do_sample, logits_processor=processors, mode="triton+graph"
        ),
    }
    with torch.no_grad():
        results = {
            name: median_ms(lambda r=r: r(block, anchor_ids), args.warmup, args.reps) for name, r in rollouts.items()
        }
        if not do_sample:  # the three paths must agree before their timings mean anything
            reference = rollouts[eager_name](block, anchor_ids).ids
            agreement = {
                name: float((r(block, anchor_ids).ids == reference).float().mean()) for name, r in rollouts.items()
            }
        else:
            agreement = dict.fromkeys(rollouts)  # sampled drafts are random: nothing to compare

    eager = results[eager_name]
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
