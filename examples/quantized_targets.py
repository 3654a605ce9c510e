"""Quantized SmolLM2 targets with the shipped drafter: whether generate() with it answers as the target alone does.

For each quantization (torch.ao's `quantize_dynamic`; torchao's `Int8WeightOnlyConfig` and
`Int8DynamicActivationInt8WeightConfig`, where torchao is installed; bitsandbytes' 4-bit NF4 and 8-bit LLM.int8, where
bitsandbytes is), greedy on one prompt: the target alone's answer, how far one forward over that answer moves its
logits from the target alone's steps (largest absolute difference; unquantized fp32 moves them by about 1e-4) and how
many of its tokens that forward picks again (teacher forcing: what verification reads), and whether transformers'
prompt lookup and the drafter (eager, then prepared for the CPU) give the same answer. docs/usage.md ("Limits")
quotes it:

    python examples/quantized_targets.py
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

import hf_domino
from hf_domino.assets import load_drafter, load_target, load_tokenizer, smollm2_gguf_path
from hf_domino.dense_gguf import dense_gguf_cache

PROMPT = [{"role": "user", "content": "Write a haiku about dominoes."}]


def quantizations() -> dict:
    """Name -> a function that loads the SmolLM2 target quantized that way."""

    def quantized(quantize):
        return lambda: quantize(load_target("smollm2", device="cpu")[0])

    found = {
        "unquantized (fp32)": quantized(lambda m: m),
        "torch.ao quantize_dynamic": quantized(lambda m: torch.ao.quantization.quantize_dynamic(m, {torch.nn.Linear})),
    }
    if importlib.util.find_spec("torchao") is not None:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        for config in (Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig):
            found[f"torchao {config.__name__}"] = quantized(lambda m, config=config: quantize_(m, config()) or m)
    if importlib.util.find_spec("bitsandbytes") is not None:
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        load_target("smollm2", device="cpu")  # writes the dense folder bitsandbytes quantizes as it loads
        folder = dense_gguf_cache(smollm2_gguf_path())
        for name, config in [
            ("bitsandbytes 4-bit NF4", BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")),
            ("bitsandbytes 8-bit LLM.int8", BitsAndBytesConfig(load_in_8bit=True)),
        ]:
            found[name] = lambda config=config: AutoModelForCausalLM.from_pretrained(
                folder, quantization_config=config, device_map="cpu"
            ).eval()
    return found


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(
        "| quantization | answer's tokens | logits moved by one forward | picked again by it | prompt lookup | drafter "
        "| prepared |"
    )
    print("| --- | ---: | ---: | ---: | --- | --- | --- |")
    tokenizer = load_tokenizer("smollm2")
    for name, load in quantizations().items():
        target = load()
        drafter = load_drafter().to(torch.float32)
        inputs = tokenizer.apply_chat_template(
            PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        prompt_length = inputs["input_ids"].shape[1]
        greedy = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
        steps = target.generate(**inputs, **greedy, output_logits=True, return_dict_in_generate=True)
        alone, answer = steps.sequences, steps.sequences[0, prompt_length:]
        one_forward = target(alone).logits[0, prompt_length - 1 : -1].float()
        moved = (one_forward - torch.cat(steps.logits).float()).abs().max().item()
        picked = one_forward.argmax(-1)
        lookup = target.generate(**inputs, **greedy, prompt_lookup_num_tokens=5)
        drafted = target.generate(**inputs, **greedy, assistant_model=drafter)
        hf_domino.prepare_for_cpu_decoding(target, drafter)
        prepared = target.generate(**inputs, **greedy, assistant_model=drafter)
        same = ["same" if torch.equal(output, alone) else "differs" for output in (lookup, drafted, prepared)]
        print(f"| {name} | {len(answer)} | {moved:.1e} | {int((picked == answer).sum())} | " + " | ".join(same) + " |")


if __name__ == "__main__":
    main()
