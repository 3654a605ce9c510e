"""Why verifying 2 tokens costs ~1.6 single-token forwards on this CPU while 8 cost ~1.4: where the time goes.

Prints, for SmolLM2-135M-Instruct on the CPU (fp32, 2 threads, an MT-Bench prompt in the cache):
1. the target forward's time by tokens per forward, with and without the hidden states a Domino drafter asks for
   (the one thing our side of the loop adds to the target's forward);
2. the time of one of the target's linear layers (the MLP's gate projection, 576 -> 1536) by rows, which is where
   the forward spends ~80% of its time (torch profiler: aten::mm).

    python examples/verify_cost.py [--threads 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers.cache_utils import DynamicCache

from hf_domino import assets


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = assets.load_target("smollm2")
    drafter = assets.load_drafter()
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    prompt = assets.encode_chat(tokenizer, assets.load_prompts("mtbench", 1)[0])
    cache = DynamicCache(config=target.config)
    target(prompt, past_key_values=cache, logits_to_keep=1)

    def forward(tokens: int, hidden_states) -> None:
        target(prompt[:, -1:].expand(1, tokens), past_key_values=cache, output_hidden_states=hidden_states)
        cache.crop(-tokens)

    lengths = (1, 2, 3, 4, 5, 8, 17)
    print("| tokens per forward | " + " | ".join(map(str, lengths)) + " |")
    print("|---|" + "---:|" * len(lengths))
    for label, hidden_states in (("plain", False), ("+ drafter's hidden states", layers)):
        forward(1, hidden_states)  # warm-up
        row = [fastest_ms(lambda n=n, h=hidden_states: forward(n, h), args.repeats) for n in lengths]
        print(f"| ms, {label} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")
    weight = target.model.layers[0].mlp.gate_proj.weight
    rows = [
        fastest_ms(lambda m=m: torch.nn.functional.linear(torch.randn(m, weight.shape[1]), weight), 50)
        for m in lengths
    ]
    print("| gate_proj (576 -> 1536), us | " + " | ".join(f"{1000 * ms:.0f}" for ms in rows) + " |")


if __name__ == "__main__":
    main()
