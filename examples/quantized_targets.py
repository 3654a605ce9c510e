"""Quantized SmolLM2 targets with the shipped drafter: whether generate() with it answers as the target alone does.

For each quantization (torch.ao's `quantize_dynamic`; torchao's `Int8WeightOnlyConfig` and
`Int8DynamicActivationInt8WeightConfig`, where torchao is installed), greedy on one prompt: the target alone's answer,
how many of its tokens one forward over that answer picks again (teacher forcing: what verification reads), and
whether transformers' prompt lookup and the drafter (eager, then prepared for the CPU) give the same answer.
docs/usage.md ("Limits") quotes it:

    python examples/quantized_targets.py
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

import hf_domino
from hf_domino.assets import load_drafter, load_target

PROMPT = [{"role": "user", "content": "Write a haiku about dominoes."}]


def quantizations() -> dict:
    found = {"torch.ao quantize_dynamic": lambda m: torch.ao.quantization.quantize_dynamic(m, {torch.nn.Linear})}
    if importlib.util.find_spec("torchao") is not None:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        for config in (Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig):
            found[f"torchao {config.__name__}"] = lambda m, config=config: quantize_(m, config()) or m
    return found


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print("| quantization | answer's tokens | picked again by one forward | prompt lookup | drafter | prepared |")
    print("| --- | ---: | ---: | --- | --- | --- |")
    for name, quantize in quantizations().items():
        target, tokenizer = load_target("smollm2", device="cpu")
        target = quantize(target)
        drafter = load_drafter().to(torch.float32)
        inputs = tokenizer.apply_chat_template(
            PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        prompt_length = inputs["input_ids"].shape[1]
        greedy = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
        alone = target.generate(**inputs, **greedy)
        answer = alone[0, prompt_length:]
        picked = target(alone).logits[0, prompt_length - 1 : -1].argmax(-1)
        lookup = target.generate(**inputs, **greedy, prompt_lookup_num_tokens=5)
        drafted = target.generate(**inputs, **greedy, assistant_model=drafter)
        hf_domino.prepare_for_cpu_decoding(target, drafter)
        prepared = target.generate(**inputs, **greedy, assistant_model=drafter)
        same = ["same" if torch.equal(output, alone) else "differs" for output in (lookup, drafted, prepared)]
        print(f"| {name} | {len(answer)} | {int((picked == answer).sum())} | " + " | ".join(same) + " |")


if __name__ == "__main__":
    main()
