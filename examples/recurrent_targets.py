"""What drafting costs for a target with recurrent layers: a Qwen3.5- or Nemotron-H-shaped model, random weights.

No drafter is trained for such a target and none installs offline, so acceptance is not measured here; what is:

- a target forward over 1, 2, 3, 5, 9 and 17 tokens of a filled cache, as a verification runs it (the scan's inputs
  kept, and on a CPU the scan as one chunk of the forward's tokens: `recurrent_cache_domino.RecurrentRollback`), beside the
  same forward with the scan's own chunks, against the target alone's one-token step;
- what a verification with rejected drafts costs after it: the state after its accepted tokens recomputed from the
  scan's own inputs (the default) against the forward that re-reads them (the fallback where no inputs were kept);
- `generate()` with a drafter of random weights (every draft rejected), twice in one process, against the target
  alone: the first call also measures the target's verify-cost table, the second shows where the adaptive policy
  settles when drafting cannot pay. Outputs are compared.

    python examples/recurrent_targets.py                 # Qwen3.5-0.8B's widths, 24 layers: about 2 minutes here
    python examples/recurrent_targets.py --layers 4      # quicker
    python examples/recurrent_targets.py --layers 4 --context 64 --repeats 1 --threads 1 --vocab-size 4096  # tests' run
    python examples/recurrent_targets.py --prepared      # after prepare_for_cpu_decoding(target, drafter)
    python examples/recurrent_targets.py --family nemotron_h --layers 8   # Nemotron-H-8B's widths, 8 of its layers
    python examples/recurrent_targets.py --device cuda --dtype bfloat16   # a GPU (examples/gpu/stages.sh recurrent)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, NemotronHConfig, NemotronHForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from hf_domino import DominoConfig, DominoForSpeculation, prepare_for_cpu_decoding
from hf_domino.cache_domino import cache_argument
from hf_domino.cost_model_domino import synchronize
from hf_domino.recurrent_cache_domino import RecurrentRollback, record_past

# Qwen3.5-0.8B's sizes (three Gated DeltaNet layers to one attention layer); Nemotron-H-8B's (Mamba2 mixers, MLPs and
# one attention layer in eight, its first layers' pattern repeated), chunks of 128 tokens.
FAMILIES = {
    "qwen3_5": (
        Qwen3_5TextConfig,
        Qwen3_5ForCausalLM,
        dict(
            vocab_size=151936, hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
            linear_value_head_dim=128, tie_word_embeddings=True,
        ),
    ),
    "nemotron_h": (
        NemotronHConfig,
        NemotronHForCausalLM,
        dict(
            vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_attention_heads=32,
            num_key_value_heads=8, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
            chunk_size=128,
        ),
    ),
}  # fmt: skip
NEMOTRON_PATTERN = ["linear_attention", "mlp"] * 3 + ["linear_attention", "full_attention"]
LENGTHS = (1, 2, 3, 5, 9, 17)


def build_target(family: str, layers: int, vocab_size: int | None = None) -> torch.nn.Module:
    config_class, model_class, widths = FAMILIES[family]
    extra = {"layers_block_type": (NEMOTRON_PATTERN * layers)[:layers]} if family == "nemotron_h" else {}
    if vocab_size is not None:
        extra["vocab_size"] = vocab_size
    config = config_class(**{**widths, **extra}, num_hidden_layers=layers, eos_token_id=None, pad_token_id=0)
    return model_class(config).eval()


def forward_ms(target, context: torch.Tensor, tokens: int, verifying: str | None, reps: int = 4) -> float:
    """Median ms of a forward over `tokens` new tokens on a cache filled with `context` (the first rep a warm-up):
    a one-token step (`verifying=None`), or a verification, as drafting runs it (`"drafting"`: the convolution history
    recorded, the scan's inputs kept, on a CPU one chunk) or with the scan's own chunks (`"own chunks"`)."""
    samples = []
    with torch.no_grad():
        for _ in range(reps + 1):
            cache = DynamicCache(config=target.config)
            target(context, use_cache=True, **cache_argument(cache), logits_to_keep=1)
            rollback = None
            if verifying is not None:
                record_past(cache)
            if verifying == "drafting":
                rollback = RecurrentRollback.install(cache, committed=context.shape[1], target=target)
                rollback.feed(context.shape[1] + tokens)
            synchronize(context.device)
            start = time.perf_counter()
            target(context[:, -tokens:], use_cache=True, **cache_argument(cache), logits_to_keep=tokens)
            synchronize(context.device)
            samples.append(time.perf_counter() - start)
            if rollback is not None:
                rollback.remove()
    return 1000 * statistics.median(samples[1:])


def after_rejection_ms(
    target, context: torch.Tensor, kept: int, block: int = 17, reps: int = 4
) -> tuple[float, float]:
    """Median ms, after a verification of `block` tokens of which `kept` stay, of setting the states to those `kept`
    tokens from the scan's inputs, and of the forward that reads them again (with the next token) instead."""
    replays, rereads = [], []
    with torch.no_grad():
        for _ in range(reps + 1):
            cache = DynamicCache(config=target.config)
            target(context, use_cache=True, **cache_argument(cache), logits_to_keep=1)
            record_past(cache)
            rollback = RecurrentRollback.install(cache, committed=context.shape[1], target=target)
            rollback.feed(context.shape[1] + block)
            target(context[:, -block:], use_cache=True, **cache_argument(cache), logits_to_keep=block)
            synchronize(context.device)
            start = time.perf_counter()
            rollback.crop(kept - block)
            synchronize(context.device)
            replays.append(time.perf_counter() - start)
            rollback.remove()
            start = time.perf_counter()
            target(context[:, -kept - 1 :], use_cache=True, **cache_argument(cache), logits_to_keep=kept + 1)
            synchronize(context.device)
            rereads.append(time.perf_counter() - start)
    return 1000 * statistics.median(replays[1:]), 1000 * statistics.median(rereads[1:])


def timed(call, *args, **kwargs):
    """(seconds, result) of `call(*args, **kwargs)`, the device's queue drained at both ends."""
    device = args[0].device
    synchronize(device)
    start = time.perf_counter()
    result = call(*args, **kwargs)
    synchronize(device)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5", choices=sorted(FAMILIES))
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen3.5-0.8B has 24)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per generate() call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256, help="tokens cached under each measured forward")
    parser.add_argument("--repeats", type=int, default=4, help="timed forwards per figure, after a warm-up")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prepared", action="store_true", help="prepare_for_cpu_decoding(target, drafter) first")
    parser.add_argument(
        "--vocab-size", type=int, help="instead of the family's (a quick check: its LM head is in every figure)"
    )
    args = parser.parse_args()
    if args.vocab_size is not None and args.vocab_size < 1000:
        parser.error("--vocab-size must be at least 1000: the prompts are drawn from the first 1000 tokens")
    first_attention = {"qwen3_5": 4, "nemotron_h": len(NEMOTRON_PATTERN)}[args.family]
    if args.layers < first_attention:
        parser.error(f"--layers must be at least {first_attention} for {args.family}, where its first attention layer "
                     "is: transformers counts a cache's tokens there")  # fmt: skip
    if args.prepared and args.device != "cpu":
        parser.error("--prepared is the CPU fast path: drop it on a GPU")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    target = build_target(args.family, args.layers, args.vocab_size).to(args.device, dtype)
    config = target.config
    layers = [1, args.layers // 2, args.layers - 2]
    drafter = DominoForSpeculation(DominoConfig.from_target(config, num_hidden_layers=1, target_layer_ids=layers))
    drafter = drafter.eval().to(args.device, dtype)
    if args.prepared:
        print(prepare_for_cpu_decoding(target, drafter), "\n")
    context = torch.randint(0, 1000, (1, args.context), device=args.device)

    # A warm-up: the first forwards after loading or packing are slower.
    forward_ms(target, context, 1, verifying=None, reps=args.repeats)
    step = forward_ms(target, context, 1, verifying=None, reps=args.repeats)
    print(f"{args.family}, {args.layers} layers, {sum(p.numel() for p in target.parameters()) / 1e6:.0f}M parameters, "
          f"{args.dtype} on {args.device}, {args.threads} threads, {args.context} tokens cached"
          f"{', prepared' if args.prepared else ''}\n")  # fmt: skip
    print("| tokens | as drafting verifies, ms | x the step | with the scan's own chunks, ms | x the step |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    print(f"| 1 (the target alone's step) | {step:.1f} | 1.00 | | |")
    for tokens in LENGTHS:
        drafting, own = (
            forward_ms(target, context, tokens, verifying=how, reps=args.repeats) for how in ("drafting", "own chunks")
        )
        print(f"| {tokens} | {drafting:.1f} | {drafting / step:.2f} | {own:.1f} | {own / step:.2f} |")

    print("\n| tokens kept of a 17-token verification | states from the scan's inputs, ms | re-read forward, ms |")
    print("| ---: | ---: | ---: |")
    for kept in (1, 4, 16):
        replay, reread = after_rejection_ms(target, context, kept, reps=args.repeats)
        print(f"| {kept} | {replay:.1f} | {reread:.1f} |")

    prompt, options = context[:, : min(64, args.context)], dict(max_new_tokens=args.new_tokens, do_sample=False)
    target.generate(prompt, max_new_tokens=2, do_sample=False)  # warm-up
    print("\n| call | target alone, s | with the drafter, s | speedup | drafts verified | identical |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for call in (1, 2):
        alone, expected = timed(target.generate, prompt, **options)
        drafted, output = timed(target.generate, prompt, assistant_model=drafter, **options)
        verified = sum(drafter.last_generation_stats.drafted)
        same = "yes" if torch.equal(output, expected) else "NO"
        print(f"| {call} | {alone:.1f} | {drafted:.1f} | {alone / drafted:.2f}x | {verified} | {same} |")


if __name__ == "__main__":
    main()
