"""How many torch ops a drafting cycle dispatches, against a plain decoding step, and where they come from.

On a GPU a small target waits on its host: the fourth GPU run (one H100, SmolLM2-135M in bf16) measured 137 ms of
device time in 2.0 s of wall time for two whole-block calls, at 25-60 us of host time per torch op
(docs/benchmarks.md, "Fourth run on a GPU"). So what a cycle costs there is close to how many ops it dispatches,
which any machine can count: this script counts them (a `TorchDispatchMode`, every op below autograd, views
included) for `generate()` with a drafter (whole blocks, the fixed policy) and without, and attributes each op to the
innermost line of hf_domino or transformers that issued it.

Models: SmolLM2-135M's configuration (a Llama of 30 layers, 9 query and 3 key/value heads) and the shipped drafter's
(2 layers), random weights, fp32 on the CPU, the eager head (on CUDA the fused head is one CUDA graph):

    python examples/cycle_ops.py --new-tokens 32 --top 25

The counts per layer do not depend on the widths: `--tiny` builds the same layers and heads 8 times narrower, with a
vocabulary of 512 (the suite runs it so; its random drafter accepts otherwise, so its cycles differ).
"""

from __future__ import annotations

import argparse
import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from hf_domino import DominoConfig, DominoForSpeculation
from hf_domino.assets import drafter_folder

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)  # fmt: skip
TINY = dict(hidden_size=72, intermediate_size=192, head_dim=8, vocab_size=512)
OURS = ("hf_domino", "transformers")


class OpCounter(TorchDispatchMode):
    """Counts every dispatched op by the innermost hf_domino/transformers line above it (`site`)."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sites[site(traceback.extract_stack(limit=40))] += 1
        return func(*args, **(kwargs or {}))


def site(stack: traceback.StackSummary) -> str:
    for frame in reversed(stack):
        if any(f"/{name}/" in frame.filename for name in OURS) and "_python_dispatch" not in frame.filename:
            path = frame.filename.split("site-packages/")[-1].split("src/")[-1]
            return f"{path}:{frame.lineno} ({frame.name})"
    return "elsewhere"


def count_ops(generate) -> OpCounter:
    counter = OpCounter()
    with counter:
        generate()
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=25, help="sites listed, by extra ops per cycle")
    parser.add_argument("--tiny", action="store_true", help="the same layers and heads at toy widths")
    args = parser.parse_args()
    torch.manual_seed(0)
    sizes = SMOLLM2 | (TINY if args.tiny else {})
    target = LlamaForCausalLM(LlamaConfig(**sizes, pad_token_id=2, eos_token_id=2, bos_token_id=1)).eval()
    shipped = DominoConfig.from_pretrained(drafter_folder(None))
    config = DominoConfig.from_target(
        target.config, num_hidden_layers=shipped.num_hidden_layers, block_size=shipped.block_size,
        target_layer_ids=shipped.target_layer_ids, mask_token_id=shipped.mask_token_id, with_domino_head=True,
        emb_dim=shipped.emb_dim // (8 if args.tiny else 1), gru_hidden_dim=shipped.gru_hidden_dim // (8 if args.tiny else 1),
        shift_label=shipped.shift_label,
    )  # fmt: skip
    drafter = DominoForSpeculation(config).eval()  # random weights: every draft after the first is rejected
    prompt = torch.randint(3, sizes["vocab_size"], (1, 64))
    options = dict(do_sample=False, eos_token_id=None)

    def plain(new_tokens: int) -> None:
        target.generate(prompt, **options, max_new_tokens=new_tokens)

    def drafted(new_tokens: int) -> None:
        target.generate(prompt, assistant_model=drafter, draft_policy="fixed", **options, max_new_tokens=new_tokens)

    with torch.inference_mode():
        for _ in range(2):  # warm-up: lazy initialisation and caches built once per process
            plain(args.new_tokens), drafted(args.new_tokens)
        # A call of one new token is the prefill and the call's setup: what every call pays once, left out below.
        plain_once, drafted_once = count_ops(lambda: plain(1)), count_ops(lambda: drafted(1))
        plain_all = count_ops(lambda: plain(args.new_tokens))
        drafted_all = count_ops(lambda: drafted(args.new_tokens))
    cycles, steps = len(drafter.last_generation_stats.acceptance_lengths), args.new_tokens - 1
    step_sites = plain_all.sites - plain_once.sites
    cycle_sites = drafted_all.sites - drafted_once.sites
    per_step, per_cycle = step_sites.total() / steps, cycle_sites.total() / cycles
    print(f"torch {torch.__version__}; {args.new_tokens} new tokens: {steps} plain steps or {cycles} drafting cycles")
    print(f"once per call: {plain_once.sites.total()} ops without the drafter, {drafted_once.sites.total()} with it")
    print(f"ops per plain step {per_step:.0f}, per drafting cycle {per_cycle:.0f} ({per_cycle / per_step:.2f}x)\n")
    extra = collections.Counter(
        {key: cycle_sites[key] / cycles - step_sites[key] / steps for key in cycle_sites | step_sites}
    )
    print("| ops per cycle beyond a plain step's | issued at |\n| ---: | --- |")
    for key, value in extra.most_common(args.top):
        print(f"| {value:.1f} | `{key}` |")


if __name__ == "__main__":
    main()
