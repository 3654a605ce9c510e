"""Micro-benchmark of one Domino head rollout (a 16-draft block): eager vs fused vs fused + graph.

Times only the sequential head, i.e. one ladder `Rollout` from a `BlockDraft` (backbone outputs and base logits) to
`Drafts`: the eager reference (`eager_rollout`) and the two fused rollouts `hf_domino.fused_head.select_rollout`
returns for `domino_rollout="triton"` and `"triton+graph"`, with random weights (bf16 by default). Shapes: Qwen3-8B's
by default (hidden 4096, GRU 1024, rank 256, vocab 151936), or the shipped SmolLM2-135M drafter's (`--shapes
smollm2-135m`: hidden 576, GRU 256, rank 64, vocab 49152), optionally over a draft vocabulary (`--draft-vocab`: a
number of token ids drawn at random, or a `draft_vocab.safetensors` file such as the shipped drafter's). All three are
called exactly as the candidate generator calls them. Prints a markdown table of the median latency per block.
With `--rows N` (N > 1) the block is drafted for N sequences at once, as the batch loop of `generate()` does: the
eager reference is then its `batched_rollout`, and the fused paths are `FusedRollout.draft_rows`.

    python examples/head_microbench.py                       # greedy
    python examples/head_microbench.py --temperature 1.0     # sampling (Gumbel-max in the fused kernels)
    python examples/head_microbench.py --temperature 0.6 --top-k 20 --top-p 0.95   # Qwen3's sampling defaults
    python examples/head_microbench.py --shapes smollm2-135m  # the shipped drafter, whole vocabulary
    python examples/head_microbench.py --shapes smollm2-135m --rows 4   # a batch of 4 rows
    python examples/head_microbench.py --shapes smollm2-135m \
        --draft-vocab src/hf_domino/checkpoints/smollm2-135m-instruct-domino/draft_vocab.safetensors

Needs a CUDA GPU and Triton; on CPU it says so and exits (the eager path at these shapes is not a useful CPU number),
unless Triton's interpreter is on (`TRITON_INTERPRET=1`): then it runs eager and fused Triton (no graph) at whatever
shapes are given, to check that the script runs (interpreter timings mean nothing), e.g.
`TRITON_INTERPRET=1 python examples/head_microbench.py --hidden-size 64 --gru-hidden-dim 32 --emb-dim 16
--vocab-size 1000 --draft-vocab 300 --reps 2 --warmup 1`.
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
from hf_domino.drafting_domino import (
    BlockDraft,
    Pick,
    eager_rollout,
    greedy_pick,
    processed_pick,
    score_only,
    spread_to_vocabulary,
)
from hf_domino.ragged_batch_domino import batched_rollout

QWEN3_8B = {"hidden_size": 4096, "gru_hidden_dim": 1024, "emb_dim": 256, "vocab_size": 151936}
SHAPES = {
    "qwen3-8b": QWEN3_8B,
    "smollm2-135m": {"hidden_size": 576, "gru_hidden_dim": 256, "emb_dim": 64, "vocab_size": 49152},
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
    dtype = DTYPES[args.dtype]
    with torch.device(device):
        drafter = DominoForSpeculation(config).to(dtype).eval()
        embed = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
    return drafter, embed


def load_draft_vocab(spec: str | None, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """`--draft-vocab`: `None`/"0" for the whole vocabulary, a count of random ids, or a draft_vocab.safetensors."""
    if spec is None or spec == "0":
        return None
    if spec.isdigit():
        if int(spec) > vocab_size:
            raise SystemExit(f"--draft-vocab {spec} exceeds the vocabulary ({vocab_size} tokens).")
        ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[: int(spec)]
    else:
        from safetensors.torch import load_file

        ids = load_file(spec)["draft_vocab"].long()
        if int(ids.max()) >= vocab_size:
            raise SystemExit(f"{spec} holds token ids up to {int(ids.max())}, beyond --vocab-size {vocab_size}.")
    return torch.sort(ids).values.to(device)


def logits_processor(temperature: float | None, top_k: int | None = None, top_p: float | None = None):
    """The processor list generate() builds for greedy decoding or sampling (`None` when empty): a temperature,
    then top-k and top-p."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if temperature is None:
        return None
    processors = LogitsProcessorList()
    if temperature != 1.0:  # transformers adds no warper for temperature 1
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    return processors or None


def eager_pick(processors, do_sample: bool, vocab_size: int, vocab: torch.Tensor | None) -> Pick:
    """The pick the candidate generator gives `eager_rollout` for this decoding mode."""
    if not do_sample:
        return greedy_pick
    return processed_pick(processors, True, vocab, vocab_size)


def row_drafters(drafter, target, block: BlockDraft, anchor_ids, processors, do_sample: bool, vocab_size: int):
    """`(eager, fused, fused + graph)` drafting callables `() -> draft ids`, for one row (the ladder's rollouts, as
    the candidate generator calls them) or for several (as the batch loop calls them); the graph's is None under
    the interpreter (CUDA graphs need CUDA)."""
    from hf_domino.fused_head import select_rollout

    def fused(mode: str):
        rollout = select_rollout(drafter, target, do_sample=do_sample, logits_processor=processors, mode=mode)
        if block.hidden.shape[0] == 1:
            return lambda: rollout(block, anchor_ids).ids
        return lambda: rollout.draft_rows(block.hidden, block.base_logits, block.vocab, anchor_ids)[0]

    if block.hidden.shape[0] == 1:
        eager = eager_rollout(drafter, target, eager_pick(processors, do_sample, vocab_size, block.vocab))

        def eager_ids():
            return eager(block, anchor_ids).ids
    else:

        def pick_logits(logits, drafted):  # as the batch loop's
            if not score_only(processors):
                logits = spread_to_vocabulary(logits, block.vocab, vocab_size)
            return processors(drafted, logits.float())

        def eager_ids():
            return batched_rollout(
                drafter, target, block.hidden, block.base_logits, block.vocab, anchor_ids,
                head=True, pick_logits=pick_logits if do_sample else None, do_sample=do_sample,
            ).ids  # fmt: skip

    graph = None if block.hidden.device.type != "cuda" else fused("triton+graph")
    return eager_ids, fused("triton"), graph


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-drafts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1, help="sequences drafted together (a batch), default 1")
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default greedy)")
    parser.add_argument("--top-k", type=int, default=None, help="when sampling, top-k after the temperature")
    parser.add_argument("--top-p", type=float, default=None, help="when sampling, top-p after top-k")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-8b", help="defaults for the four sizes")
    parser.add_argument(
        "--draft-vocab",
        default=None,
        help="draft over a vocabulary: a number of random token ids, or a draft_vocab.safetensors (default: none)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="head and embedding weights")
    for name in QWEN3_8B:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="overrides --shapes")
    args = parser.parse_args()
    for name, value in SHAPES[args.shapes].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    from hf_domino.triton_kernels import kernels_interpreted

    interpreted = kernels_interpreted()
    if not torch.cuda.is_available() and not interpreted:
        print("head_microbench.py measures GPU kernels and needs a CUDA device; none is available here.")
        sys.exit(0)
    import triton

    torch.manual_seed(0)
    device = torch.device("cpu" if interpreted else "cuda")
    drafter, embed = build_head(args, device)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    vocab = load_draft_vocab(args.draft_vocab, args.vocab_size, device)
    columns = args.vocab_size if vocab is None else len(vocab)
    rows, dtype = args.rows, DTYPES[args.dtype]
    draft_hidden = torch.randn(rows, args.num_drafts, args.hidden_size, device=device, dtype=dtype)
    block = BlockDraft(draft_hidden, torch.randn(rows, args.num_drafts, columns, device=device) * 4, vocab)
    anchor_ids = torch.randint(0, args.vocab_size, (rows, 1), device=device)
    do_sample = args.temperature is not None
    processors = logits_processor(args.temperature, args.top_k, args.top_p)

    eager_name = "eager (`eager_rollout`)" if rows == 1 else "eager (`batched_rollout`)"
    eager, fused, graph = row_drafters(drafter, target, block, anchor_ids, processors, do_sample, args.vocab_size)
    rollouts = {eager_name: eager, "fused Triton": fused}
    if graph is not None:
        rollouts["fused Triton + CUDA graph"] = graph
    with torch.no_grad():
        results = {name: median_ms(draft, args.warmup, args.reps) for name, draft in rollouts.items()}
        if not do_sample:  # the three paths must agree before their timings mean anything
            reference = eager()
            agreement = {name: float((draft() == reference).float().mean()) for name, draft in rollouts.items()}
        else:
            agreement = dict.fromkeys(rollouts)  # sampled drafts are random: nothing to compare

    eager = results[eager_name]
    device_name = (
        "CPU, Triton interpreter (timings meaningless)" if interpreted else torch.cuda.get_device_name(device)
    )
    print(
        f"Device: {device_name}; torch {torch.__version__}; triton {triton.__version__}; "
        f"Python {platform.python_version()}"
    )
    draft_vocab = "whole vocabulary" if vocab is None else f"draft vocabulary of {len(vocab)} tokens"
    print(
        f"Shapes: hidden {args.hidden_size}, GRU {args.gru_hidden_dim}, rank {args.emb_dim}, vocab {args.vocab_size} "
        f"({draft_vocab}), {args.num_drafts} drafts{f' for each of {rows} rows' if rows > 1 else ''}, "
        f"{args.dtype} weights, "
        f"{'greedy' if args.temperature is None else f'T={args.temperature}'}"
        f"{f', top-k {args.top_k}' if do_sample and args.top_k else ''}"
        f"{f', top-p {args.top_p}' if do_sample and args.top_p is not None else ''}"
    )
    print(f"Command: `python {shlex.join(sys.argv)}` (median of {args.reps} blocks after {args.warmup} warm-up)\n")
    print("| path | ms / block | speedup vs eager | drafts equal to eager |")
    print("|---|---:|---:|---:|")
    for name, ms in results.items():
        equal = "n/a (sampling)" if agreement[name] is None else f"{agreement[name]:.0%}"
        print(f"| {name} | {ms:.3f} | {eager / ms:.2f}x | {equal} |")


if __name__ == "__main__":
    main()
