"""Why verifying 2 tokens costs ~1.6 single-token forwards on this CPU while 8 cost ~1.4: where the time goes.

Prints, for SmolLM2-135M-Instruct on the CPU (fp32, 2 threads, an MT-Bench prompt in the cache):
1. the target forward's time by tokens per forward, with and without the hidden states a Domino drafter asks for
   (the one thing our side of the loop adds to the target's forward);
2. the time of one of the target's linear layers (the MLP's gate projection, 576 -> 1536) by rows, which is where
   the forward spends ~80% of its time (torch profiler: aten::mm);
3. with `--paths`, the forward's time on the CPU fast paths as well: `prepacked` (hf_domino.prepare_for_cpu_decoding,
   oneDNN-packed weights) and `compile` (torch.compile with inductor's weight freezing, dynamic shapes; the time
   spent compiling is printed, since every new number of tokens per forward may compile again).

    python examples/verify_cost.py [--threads 2] [--repeats 7] [--paths eager,prepacked,compile]
        [--target FOLDER --gguf-file NAME] [--dtype bfloat16]

Another target (a folder, with `--gguf-file` for a GGUF checkpoint in it) is timed the same way; the hidden states
asked are those a drafter built for it by `DominoConfig.from_target` would read.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._inductor.config as inductor_config
from transformers.cache_utils import DynamicCache

from hf_domino import DominoConfig, assets, prepare_for_cpu_decoding, prompt_sets
from hf_domino.cache_domino import cache_argument


def fastest_ms(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1000 * min(samples)  # other work on the machine only ever adds time


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--paths", default="eager", help="comma-separated: eager, prepacked, compile")
    parser.add_argument("--target", default="smollm2", help="smollm2, or a model folder")
    parser.add_argument("--gguf-file", default=None, help="a GGUF checkpoint inside --target")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    paths = [path.strip() for path in args.paths.split(",")]
    if unknown := set(paths) - {"eager", "prepacked", "compile"}:
        parser.error(f"unknown --paths {sorted(unknown)}: choose among eager, prepacked, compile")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    def load():
        return assets.load_target(args.target, gguf_file=args.gguf_file, dtype=dtype, device="cpu")

    target, tokenizer = load()
    if args.target == "smollm2" and args.gguf_file is None:
        layer_ids = assets.load_drafter().config.target_layer_ids
    else:
        layer_ids = DominoConfig.from_target(target.config).target_layer_ids
    layers = [i + 1 for i in layer_ids]
    prompt = assets.encode_chat(tokenizer, prompt_sets.load_prompts("mtbench", 1)[0])
    lengths = (1, 2, 3, 4, 5, 8, 17)

    def timed_row(model, label: str, hidden_states) -> None:
        cache = DynamicCache(config=model.config)
        model(prompt, **cache_argument(cache), logits_to_keep=1)

        def forward(tokens: int) -> None:
            model(prompt[:, -1:].expand(1, tokens), **cache_argument(cache), output_hidden_states=hidden_states)
            cache.crop(-tokens)

        start = time.perf_counter()
        for n in lengths:  # warm-up (and, compiled, compiling wherever a new length needs it)
            forward(n)
        warmup = time.perf_counter() - start
        row = [fastest_ms(lambda n=n: forward(n), args.repeats) for n in lengths]
        label += f" ({warmup:.0f} s compiling)" if "compiled" in label else ""
        print(f"| ms, {label} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")

    print("| tokens per forward | " + " | ".join(map(str, lengths)) + " |")
    print("|---|" + "---:|" * len(lengths))
    if "eager" in paths:
        timed_row(target, "plain", False)
        timed_row(target, "+ drafter's hidden states", layers)
    if "prepacked" in paths:
        prepare_for_cpu_decoding(target)
        timed_row(target, "prepacked (prepare_for_cpu_decoding)", layers)
    if "compile" in paths:  # a copy of its own: inductor's freezing packs the dense weights itself
        inductor_config.freezing = True
        compiled, _ = load()
        compiled.forward = torch.compile(compiled.forward, dynamic=True)
        timed_row(compiled, "compiled, freezing, dynamic shapes", layers)
    weight = target.model.layers[0].mlp.gate_proj.weight
    rows = [
        fastest_ms(lambda m=m: torch.nn.functional.linear(torch.randn(m, weight.shape[1], dtype=dtype), weight), 50)
        for m in lengths
    ]
    shape = f"{weight.shape[1]} -> {weight.shape[0]}"
    print(f"| gate_proj ({shape}), us | " + " | ".join(f"{1000 * ms:.0f}" for ms in rows) + " |")


if __name__ == "__main__":
    main()
