"""Packed or not, per row count: what `prepare_for_cpu_decoding` measured on this CPU, and what it buys end to end.

`prepare_for_cpu_decoding` times `F.linear` against the oneDNN-packed product for each weight shape at 1-17 rows and
keeps `F.linear` where it measured faster (`hf_domino.prepacked_linear.measure_linear_dispatch`). This prints those
decisions for the offline SmolLM2 target and the shipped drafter, both products' times per target weight shape, then
times `generate()` three ways on the same
prepared models, interleaved per prompt: every product packed (the fast path before the measurement), the measured
choice (the default), every product eager (`eager_linears()`, a target never prepared), for the target alone and
with the drafter, and says whether the outputs are the packed run's.

    python examples/linear_dispatch.py [--threads 2] [--num-prompts 3] [--max-new-tokens 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from hf_domino import assets, prepare_for_cpu_decoding, prompt_sets
from hf_domino.prepacked_linear import PrepackedLinear, eager_linears

MODES = ("packed", "measured", "eager")
PRODUCT_ROWS = (1, 2, 3, 5, 9, 17)  # the products' table: F.linear / packed microseconds


def use(
    mode: str, modules: list[PrepackedLinear], measured: dict[int, frozenset[int]]
) -> contextlib.AbstractContextManager:
    """Sets every module's dispatch for `mode`; the context to generate in."""
    for module in modules:
        module._eager_rows = measured[id(module)] if mode == "measured" else frozenset()
    return eager_linears() if mode == "eager" else contextlib.nullcontext()


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=3, help="MT-Bench prompts (the first also warms up)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts; times add up")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = assets.load_target("smollm2", device="cpu")
    drafter = assets.load_drafter()
    start = time.perf_counter()
    report = prepare_for_cpu_decoding(target, drafter)
    prepared = time.perf_counter() - start  # the products' timings and the verify-cost table
    print(f"threads {args.threads}; prepared in {prepared:.1f} s; {report}")
    print("\nrows multiplied with F.linear, by weight shape (out x in):")
    for name, dispatch in report.eager_rows.items():
        for (out_features, in_features, _), rows in dispatch.items():
            print(f"  {name} {out_features} x {in_features}: {sorted(rows) or 'none'}")
    print("\n| target weight (out x in) | " + " | ".join(f"{rows} rows, us" for rows in PRODUCT_ROWS) + " |")
    print("| --- | " + " | ".join("---:" for _ in PRODUCT_ROWS) + " |")
    shapes = {(m.out_features, m.in_features): m for m in target.modules() if isinstance(m, PrepackedLinear)}
    for (out_features, in_features), module in shapes.items():  # F.linear / packed, each weight hot in cache
        cells = [module._product_seconds(rows) for rows in PRODUCT_ROWS]
        cells = " | ".join(f"{1e6 * eager:.0f} / {1e6 * packed:.0f}" for eager, packed in cells)
        print(f"| {out_features} x {in_features} | {cells} |")
    modules = [m for model in (target, drafter) for m in model.modules() if isinstance(m, PrepackedLinear)]
    measured = {id(module): module._eager_rows for module in modules}
    prompts = [assets.encode_chat(tokenizer, m) for m in prompt_sets.load_prompts("mtbench", args.num_prompts)]

    def generate(mode: str, input_ids: torch.LongTensor, assistant) -> tuple[float, torch.Tensor]:
        with use(mode, modules, measured):
            start = time.perf_counter()
            output = target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                assistant_model=assistant,
            )
            return time.perf_counter() - start, output

    print(f"\n| generate() | {' | '.join(f'{mode}, s' for mode in MODES)} | measured vs packed | outputs as packed |")
    print("| --- | " + " | ".join("---:" for _ in range(len(MODES) + 2)) + " |")
    for label, assistant in (("target alone", None), ("with the drafter", drafter)):
        for mode in MODES:
            generate(mode, prompts[0], assistant)  # warm-up
        seconds = dict.fromkeys(MODES, 0.0)
        outputs: dict[str, list[torch.Tensor]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for input_ids in prompts:
                for mode in MODES:
                    elapsed, output = generate(mode, input_ids, assistant)
                    seconds[mode] += elapsed
                    outputs[mode].append(output)
        same = all(torch.equal(a, b) for a, b in zip(outputs["packed"], outputs["measured"]))
        times = " | ".join(f"{seconds[mode]:.2f}" for mode in MODES)
        print(f"| {label} | {times} | {seconds['packed'] / seconds['measured']:.2f}x | {same} |")


if __name__ == "__main__":
    main()
