"""What one drafting cycle costs at paper scale: a Qwen3-8B-shaped target and a drafter of the published shape.

Issue 22, Part A.4. Random weights (acceptance is meaningless there), so this measures costs only:

- one target token, and a 17-token verification (anchor + 16 drafts), on a cached context (and on a cache grown in
  place, as `generate()` with a drafter grows it; and with each group's query heads packed onto their key/value head,
  `packed_query_attention`: where a masked attention over grouped key/value heads would otherwise copy every key and
  value of the cache once per query head, `repeat_kv`, before each layer's attention: is that worth leaving out?);
- the draft: backbone (5 layers over the block and the new context), LM head on the 16 draft positions, the Domino
  head rollout (eager, and the fused Triton / CUDA-graph rollouts where they run);
- what transformers' assisted loop adds per cycle: `generate(..., draft_policy="fixed")`'s `verify` timing (target
  forward plus the loop's own work) against the bare 17-token forward, with the 17-token forwards inside the loop
  timed on their own and the arguments the loop passes them printed (what can make them differ from a bare one).

It then prints the speedup these costs imply at the paper's tau of 7.17, labelled as implied. On a GPU:

    python examples/gpu/cycle_costs.py --shape qwen3-8b --dtype bfloat16

Here (a CPU) the same code runs at toy shapes, to check it end to end:

    python examples/gpu/cycle_costs.py --shape tiny --dtype float32
    python examples/gpu/cycle_costs.py --shape qwen3-8b-6-layers --dtype bfloat16 --reps 3 --new-tokens 40  # a minute
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_domino import DominoConfig, DominoForSpeculation, TargetModules
from hf_domino.attention_kernels_domino import drafting_attention_kernels
from hf_domino.cache_domino import CACHE_ARGUMENT, buffer_layers, cache_argument
from hf_domino.cost_model_domino import synchronize
from hf_domino.drafting_domino import BlockDraft, DrafterContext, eager_rollout, run_backbone
from hf_domino.modeling_domino import context_features

SHAPES = {
    # Qwen3-8B, and the published Qwen3-8B Domino drafter (docs/model.md): 5 layers, GRU 1024, rank 256.
    "qwen3-8b": dict(
        target=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936),
        drafter=dict(num_hidden_layers=5, target_layer_ids=[1, 9, 17, 25, 33], gru_hidden_dim=1024, emb_dim=256),
    ),
    # Qwen3-8B's widths in 6 layers: a size a CPU runs, to check there what the widths and the vocabulary cost.
    "qwen3-8b-6-layers": dict(
        target=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=6, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936),
        drafter=dict(num_hidden_layers=2, target_layer_ids=[1, 4], gru_hidden_dim=1024, emb_dim=256),
    ),
    # SmolLM2-135M's sizes (a Llama; Qwen3 adds only the q/k norms) and the shipped drafter's: the end-to-end
    # benches' model, at random weights, for the first call of a GPU session (the real one comes with the second).
    "smollm2-135m": dict(
        target=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152),
        drafter=dict(num_hidden_layers=2, target_layer_ids=[1, 14, 27], gru_hidden_dim=256, emb_dim=64),
    ),
    "tiny": dict(
        target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=1024),
        drafter=dict(num_hidden_layers=2, target_layer_ids=[1, 3], gru_hidden_dim=32, emb_dim=16),
    ),
}  # fmt: skip
PAPER_TAU = 7.17
PACKED_QUERIES = "sdpa_packed_queries"


def packed_query_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' `sdpa` attention, except for a masked attention over several queries and grouped key/value
    heads (a verification): each key/value head's group of query heads goes in as one head of `group x queries`
    queries, the mask repeated for each, so that no key or value is copied (`repeat_kv`), and no kernel falls back to
    the math one (CUDA's fused kernels take no mask with `enable_gqa`). Same result up to rounding."""
    rows, heads, queries, dim = query.shape
    group = heads // key.shape[1]
    if group == 1 or queries == 1 or attention_mask is None or attention_mask.shape[1] != 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    packed = query.reshape(rows, key.shape[1], group * queries, dim)
    mask = attention_mask.expand(-1, -1, queries, -1).repeat(1, 1, group, 1)
    output = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return output.reshape(rows, heads, queries, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_QUERIES, packed_query_attention)
AttentionMaskInterface.register(PACKED_QUERIES, sdpa_mask)


def median_ms(fn, device: torch.device, warmup: int = 3, reps: int = 10) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return 1000 * statistics.median(samples)


def build(shape: str, dtype: torch.dtype, device: torch.device) -> tuple[Qwen3ForCausalLM, DominoForSpeculation]:
    sizes = SHAPES[shape]
    target_config = Qwen3Config(**sizes["target"], tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    with torch.device(device):
        target = Qwen3ForCausalLM._from_config(target_config, dtype=dtype).eval()
        config = DominoConfig.from_target(
            target.config, block_size=16, mask_token_id=2, shift_label=True, with_domino_head=True, **sizes["drafter"]
        )
        drafter = DominoForSpeculation(config).to(dtype).eval()
    return target, drafter


@torch.no_grad()
def measure(target, drafter, context_tokens: int, device: torch.device, reps: int) -> dict[str, float]:
    modules = TargetModules.from_target(target)
    vocab = target.config.vocab_size
    prompt = torch.randint(3, vocab, (1, context_tokens), device=device)
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    out = target(prompt, use_cache=True, output_hidden_states=layers)
    cache = getattr(out, CACHE_ARGUMENT)
    features = context_features(out.hidden_states, drafter.config.target_layer_ids)
    costs = {}

    def forward(length: int) -> None:
        target(prompt[:, -length:], use_cache=True, **cache_argument(cache), output_hidden_states=layers)
        cache.crop(-length)

    costs["target, 1 token"] = median_ms(lambda: forward(1), device, reps=reps)
    costs["target, 17 tokens (verification)"] = median_ms(lambda: forward(17), device, reps=reps)
    if target.config.num_key_value_heads < target.config.num_attention_heads:
        reference = target(prompt[:, -17:], use_cache=True, **cache_argument(cache)).logits
        cache.crop(-17)
        target.set_attn_implementation(PACKED_QUERIES)
        packed = target(prompt[:, -17:], use_cache=True, **cache_argument(cache)).logits
        cache.crop(-17)
        costs["target, 17 tokens, query heads packed (no repeat_kv)"] = median_ms(
            lambda: forward(17), device, reps=reps
        )
        target.set_attn_implementation("sdpa")
        difference = (packed.float() - reference.float()).abs().max().item()
        print(f"packed query heads: logits within {difference:.2e} of sdpa's, argmax equal: "
              f"{torch.equal(packed.argmax(-1), reference.argmax(-1))}")  # fmt: skip
    # generate() with a drafter grows the target's cache in place (`buffer_layers`): the same forward on such a cache.
    buffered = buffer_layers(DynamicCache(config=target.config), reserve=context_tokens + 256)
    target(prompt, use_cache=True, **cache_argument(buffered))

    def forward_buffered() -> None:
        target(prompt[:, -17:], use_cache=True, **cache_argument(buffered), output_hidden_states=layers)
        buffered.crop(-17)

    costs["target, 17 tokens, cache grown in place"] = median_ms(forward_buffered, device, reps=reps)

    anchor = prompt[:, -1:]
    # A cycle's backbone reads the block and the few tokens verified since the last one; the rest is cached.
    context = DrafterContext()
    context.append(features[:, :-8])
    run_backbone(drafter, modules, anchor, context, 16)
    context.append(features[:, -8:])

    def backbone() -> torch.Tensor:
        hidden = run_backbone(drafter, modules, anchor, context, 16)
        context.cache.crop(-8)  # undo the call: the 8 new tokens leave the cache and are pending again
        context.length -= 8
        context.append(features[:, -8:])
        return hidden

    costs["draft: backbone (8 new context tokens)"] = median_ms(backbone, device, reps=reps)
    hidden = backbone()
    costs["draft: LM head, 16 positions"] = median_ms(
        lambda: BlockDraft.from_hidden(hidden, modules), device, reps=reps
    )
    block = BlockDraft.from_hidden(hidden, modules)
    eager = eager_rollout(drafter, modules)
    costs["draft: head, eager"] = median_ms(lambda: eager(block, anchor), device, reps=reps)
    if device.type == "cuda":
        try:
            from hf_domino.fused_head import select_rollout

            for mode in ("triton", "triton+graph"):
                fused = select_rollout(drafter, modules, do_sample=False, logits_processor=None, mode=mode)
                costs[f"draft: head, {mode}"] = median_ms(lambda f=fused: f(block, anchor), device, reps=reps)
        except Exception as error:  # report, do not hide: the fused path is what Part A proves
            print(f"fused head unavailable: {type(error).__name__}: {error}")
    return costs


@torch.no_grad()
def loop_overhead(
    target, drafter, context_tokens: int, device: torch.device, new_tokens: int
) -> tuple[float, float, str]:
    """What a cycle of transformers' assisted loop costs around its verification: the median `verify` timing (the
    target forward plus the loop's own work), the median of the 17-token target forwards inside that loop, and the
    arguments the loop passes to them (names and shapes), which is where a forward in the loop can differ from a bare
    one."""
    prompt = torch.randint(3, target.config.vocab_size, (1, context_tokens), device=device)
    kwargs = dict(assistant_model=drafter, draft_policy="fixed", do_sample=False, domino_timings=True)
    target.generate(prompt, max_new_tokens=8, **kwargs)
    forwards, arguments, started = [], [], []

    def verifies_a_block(args, forward_kwargs) -> bool:
        return forward_kwargs.get("input_ids", args[0] if args else None).shape[-1] == 17

    def before(module, args, forward_kwargs):
        synchronize(device)
        started.append(time.perf_counter())
        if not arguments and verifies_a_block(args, forward_kwargs):
            arguments.append(describe(forward_kwargs))

    def after(module, args, forward_kwargs, output):
        synchronize(device)
        seconds = time.perf_counter() - started.pop()
        if verifies_a_block(args, forward_kwargs):
            forwards.append(seconds)

    hooks = [
        target.register_forward_pre_hook(before, with_kwargs=True),
        target.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        target.generate(prompt, max_new_tokens=new_tokens, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    verify = drafter.last_generation_stats.timings["verify"]
    if not forwards:  # every block was cut by max_new_tokens: ask for more new tokens
        raise ValueError(f"no 17-token verification in generate(max_new_tokens={new_tokens}); pass --new-tokens 64")
    return 1000 * statistics.median(verify), 1000 * statistics.median(forwards), arguments[0]


def describe(forward_kwargs: dict) -> str:
    """`name: shape` (tensors), `name: type` (caches), `name: value` (the rest), one per argument."""
    parts = []
    for name, value in forward_kwargs.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{name}: {tuple(value.shape)} {value.dtype}")
        elif value is None or isinstance(value, (bool, int, float, str, list, tuple)):
            parts.append(f"{name}: {value!r}")
        else:
            parts.append(f"{name}: {type(value).__name__}")
    return ", ".join(parts)


@torch.no_grad()
def profile_loop(target, drafter, context_tokens: int, device: torch.device, new_tokens: int, rows: int) -> str:
    """Where a short `generate()` with the drafter spends its time: Python functions by own time (the host, where a
    launch-bound loop's overhead shows), and on CUDA the kernels by device time."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    prompt = torch.randint(3, target.config.vocab_size, (1, context_tokens), device=device)
    kwargs = dict(assistant_model=drafter, draft_policy="fixed", do_sample=False)
    generate = functools.partial(target.generate, prompt, max_new_tokens=new_tokens, **kwargs)
    generate()  # warm: the same shapes as the profiled calls
    host = cProfile.Profile()
    host.runcall(generate)
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(rows)
    report = text.getvalue()
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            generate()
        report += "\n" + trace.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)
    return report


def model_parser(description: str, shape: str) -> argparse.ArgumentParser:
    """A script's parser with the models' `--shape` (default `shape`) and `--dtype`, which `build` takes."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=shape, help="model shapes")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="weights")
    return parser


def main() -> None:
    parser = model_parser(__doc__, "qwen3-8b")
    parser.add_argument("--context-tokens", type=int, default=512, help="cached context before the block")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per cost (median)")
    parser.add_argument("--new-tokens", type=int, default=64, help="generate() length for the loop's overhead")
    parser.add_argument(
        "--profile", type=int, default=0, help="also profile a generate() of this many new tokens (0: no profile)"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    target, drafter = build(args.shape, getattr(torch, args.dtype), device)
    # the bare forwards with the attention kernels generate() with a drafter runs (no cuDNN in half precision on CUDA)
    with drafting_attention_kernels(device, target.dtype):
        costs = measure(target, drafter, args.context_tokens, device, args.reps)
    verify_in_loop, forward_in_loop, loop_arguments = loop_overhead(
        target, drafter, args.context_tokens, device, args.new_tokens
    )
    costs["target, 17 tokens, inside generate()"] = forward_in_loop
    costs["transformers' loop, per cycle (verify timing - bare 17-token forward)"] = (
        verify_in_loop - costs["target, 17 tokens (verification)"]
    )
    head = min(v for k, v in costs.items() if k.startswith("draft: head"))
    cycle = (
        costs["draft: backbone (8 new context tokens)"] + costs["draft: LM head, 16 positions"] + head
        + costs["target, 17 tokens (verification)"]
        + max(costs["transformers' loop, per cycle (verify timing - bare 17-token forward)"], 0.0)
    )  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{args.shape}, {args.dtype}, {name}, torch {torch.__version__}, context {args.context_tokens} tokens, "
        "attention kernels of a drafting call (attention_kernels_domino.drafting_attention_kernels)\n"
    )
    print("| cost | ms |\n| --- | ---: |")
    for key, value in costs.items():
        print(f"| {key} | {value:.2f} |")
    print(f"| **cycle** (fastest head) | {cycle:.2f} |")
    implied = PAPER_TAU * costs["target, 1 token"] / cycle
    print(f"\nThe loop's 17-token forward was called with: {loop_arguments}")
    print(f"\nImplied (not measured) speedup at the paper's tau {PAPER_TAU}: {implied:.2f}x (head {head / cycle:.1%})")
    if args.profile:
        print(f"\ngenerate(max_new_tokens={args.profile}) with the drafter (draft_policy='fixed'), profiled:\n")
        print(profile_loop(target, drafter, args.context_tokens, device, args.profile, rows=25))


if __name__ == "__main__":
    main()
