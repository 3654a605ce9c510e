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

`--batch-size B` counts a left-padded batch of B prompts of different lengths (issue 20's GPU goal: batches of 2-4
keeping batch 1's speedup): transformers' batched loop of the target alone against ours with the drafter, and ours
taking plain steps only (`num_speculative_tokens=0`), which separates what our loop adds from what drafting does.
Cycles and steps are counted as the target's forwards after the prefill.
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


# What an op costs a GPU's host besides its dispatch: a view launches nothing, an allocation no kernel, and these wait
# for the device (a value read back, or an output whose size the data sets).
SYNCS = {"_local_scalar_dense", "nonzero", "equal", "masked_select", "_unique2", "unique_consecutive", "unique_dim"}
ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
KINDS = ("kernel", "view", "allocation", "sync")


def kind(func) -> str:
    name = func.overloadpacket.__name__
    if name in SYNCS:
        return "sync"
    if name in ALLOCATIONS:
        return "allocation"
    return "view" if func.is_view else "kernel"


class OpCounter(TorchDispatchMode):
    """Counts every dispatched op by its kind and the innermost hf_domino/transformers line above it (`site`).
    `Tensor.tolist` dispatches nothing on a CPU but waits for the device on a GPU: it counts as a sync."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()  # (kind, site) -> ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sites[kind(func), site(traceback.extract_stack(limit=40))] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.tolist = torch.Tensor.tolist
        counter = self

        def tolist(tensor: torch.Tensor):
            counter.sites["sync", site(traceback.extract_stack(limit=40))] += 1
            return counter.tolist(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)


def by_kind(sites: collections.Counter, forwards: int) -> str:
    return ", ".join(f"{sum(n for (k, _), n in sites.items() if k == name) / forwards:.0f} {name}s" for name in KINDS)


def site(stack: traceback.StackSummary) -> str:
    for frame in reversed(stack):
        if any(f"/{name}/" in frame.filename for name in OURS) and "_python_dispatch" not in frame.filename:
            path = frame.filename.split("site-packages/")[-1].split("src/")[-1]
            return f"{path}:{frame.lineno} ({frame.name})"
    return "elsewhere"


def count_ops(generate, new_tokens: int, target: torch.nn.Module) -> tuple[OpCounter, int]:
    """The ops `generate(new_tokens)` dispatches, and how many forwards of the target it made."""
    counter, forwards = OpCounter(), []
    handle = target.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with counter:
            generate(new_tokens)
    finally:
        handle.remove()
    return counter, len(forwards)


def left_padded_prompts(batch_size: int, vocab_size: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """B random prompts of 64, 56, 48, ... tokens, left-padded as a tokenizer pads them for generation."""
    lengths = [64 - 8 * (row % 4) for row in range(batch_size)]
    input_ids = torch.full((batch_size, 64), pad_token_id)
    attention_mask = torch.zeros((batch_size, 64), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, 64 - length :] = torch.randint(3, vocab_size, (length,))
        attention_mask[row, 64 - length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def after_prefill(calls: tuple[OpCounter, int], once: tuple[OpCounter, int]) -> tuple[collections.Counter, int]:
    """The sites of a call's forwards after the prefill (a one-token call's ops left out), and how many there were."""
    return calls[0].sites - once[0].sites, calls[1] - once[1]


def extra_sites(cycle: collections.Counter, cycles: int, step: collections.Counter, steps: int) -> collections.Counter:
    return collections.Counter({key: cycle[key] / cycles - step[key] / steps for key in cycle | step})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=25, help="sites listed, by extra ops per cycle")
    parser.add_argument("--tiny", action="store_true", help="the same layers and heads at toy widths")
    parser.add_argument("--batch-size", type=int, default=1, help="rows of a left-padded batch")
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
    batch = left_padded_prompts(args.batch_size, sizes["vocab_size"], target.config.pad_token_id)
    options = dict(do_sample=False, eos_token_id=None)
    calls = {
        "plain": lambda n: target.generate(**batch, **options, max_new_tokens=n),
        "drafted": lambda n: target.generate(
            **batch, assistant_model=drafter, draft_policy="fixed", **options, max_new_tokens=n
        ),
    }
    if args.batch_size > 1:  # our loop without drafts: what the loop itself adds to transformers' step
        calls["ours, plain"] = lambda n: target.generate(
            **batch, assistant_model=drafter, num_speculative_tokens=0, **options, max_new_tokens=n
        )
    with torch.inference_mode():
        for _ in range(2):  # warm-up: lazy initialisation and caches built once per process
            for call in calls.values():
                call(args.new_tokens)
        # A call of one new token is the prefill and the call's setup: what every call pays once, left out below.
        once = {name: count_ops(call, 1, target) for name, call in calls.items()}
        counted = {name: count_ops(call, args.new_tokens, target) for name, call in calls.items()}
    runs = {name: after_prefill(counted[name], once[name]) for name in calls}
    (step_sites, steps), (cycle_sites, cycles) = runs["plain"], runs["drafted"]
    per_step, per_cycle = step_sites.total() / steps, cycle_sites.total() / cycles
    print(f"torch {torch.__version__}; {args.batch_size} row(s), {args.new_tokens} new tokens: {steps} plain steps or "
          f"{cycles} drafting cycles")  # fmt: skip
    print(f"once per call: {once['plain'][0].sites.total()} ops without the drafter, "
          f"{once['drafted'][0].sites.total()} with it")  # fmt: skip
    print(f"ops per plain step {per_step:.0f}, per drafting cycle {per_cycle:.0f} ({per_cycle / per_step:.2f}x)")
    print(f"  a plain step: {by_kind(step_sites, steps)}; a drafting cycle: {by_kind(cycle_sites, cycles)}")
    if "ours, plain" in runs:
        ours_sites, ours_steps = runs["ours, plain"]
        ours = ours_sites.total() / ours_steps
        print(f"ops per plain step of our batched loop {ours:.0f} ({ours / per_step:.2f}x transformers'): "
              f"{by_kind(ours_sites, ours_steps)}")  # fmt: skip
    print("\n| ops per cycle beyond a plain step's | kind | issued at |\n| ---: | --- | --- |")
    for (name, key), value in extra_sites(cycle_sites, cycles, step_sites, steps).most_common(args.top):
        print(f"| {value:.1f} | {name} | `{key}` |")


if __name__ == "__main__":
    main()
