"""An offloaded target with the shipped drafter: SmolLM2 dispatched by accelerate with most of its layers offloaded.

transformers runs a model larger than its device's memory by offloading part of it (`from_pretrained(...,
device_map="auto", max_memory=...)`): on a GPU the rest waits in CPU memory, on a CPU on disk (`offload_folder`),
and every forward brings it in again. A forward over a block of drafts then costs about what one token's does, so
each accepted draft saves most of a forward. This script keeps `--resident-mb` of the target on the device, offloads
the rest, and times, per prompt and interleaved: the target loaded whole, the offloaded target alone, and the
offloaded target with the drafter (greedy, fp32, the default options), checking that both offloaded answers are the
whole target's; with `--batch-size N`, left-padded batches of N prompts. docs/usage.md ("Offloaded targets") and
docs/benchmarks.md quote it:

    python examples/offloaded_target.py --prompts mtbench
    python examples/offloaded_target.py --prompts mtbench --num-prompts 8 --max-new-tokens 64 --batch-size 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from hf_domino.assets import load_drafter, load_target
from hf_domino.prompt_sets import load_humaneval, load_mtbench


def offloaded_copy(target, folder: str, resident_mb: int):
    """`target` saved and loaded again with only `resident_mb` MB on its device: the rest in CPU memory (GPU) or on
    disk (CPU)."""
    target.save_pretrained(f"{folder}/target")
    device_memory = (
        {0: f"{resident_mb}MB", "cpu": "64GB"} if target.device.type == "cuda" else {"cpu": f"{resident_mb}MB"}
    )
    return AutoModelForCausalLM.from_pretrained(
        f"{folder}/target", device_map="auto", max_memory=device_memory, offload_folder=f"{folder}/offload"
    ).eval()


def encode(tokenizer, conversations: list, device: torch.device) -> dict[str, torch.Tensor]:
    """A left-padded batch of chat prompts (one prompt: no padding)."""
    tokenizer.padding_side = "left"
    inputs = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    return inputs.to(device)


def timed(model, inputs: dict[str, torch.Tensor], **kwargs) -> tuple[torch.Tensor, float]:
    cuda = inputs["input_ids"].device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    output = model.generate(**inputs, do_sample=False, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    return output, time.perf_counter() - start


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", choices=["mtbench", "humaneval"], default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--resident-mb", type=int, default=150, help="MB of the target kept on its device")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate() call")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2")
    drafter = load_drafter().to(target.device, torch.float32)
    prompts = (load_mtbench if args.prompts == "mtbench" else load_humaneval)(args.num_prompts)
    batches = [prompts[start : start + args.batch_size] for start in range(0, len(prompts), args.batch_size)]
    with tempfile.TemporaryDirectory() as folder:
        offloaded = offloaded_copy(target, folder, args.resident_mb)
        kept = sorted({str(device) for device in offloaded.hf_device_map.values()})
        print(
            f"# {args.prompts}, {len(prompts)} prompts x {args.max_new_tokens} tokens in batches of {args.batch_size}; "
            f"device map over {kept}"
        )
        greedy = {"max_new_tokens": args.max_new_tokens}
        warm_up = encode(tokenizer, batches[0], target.device)
        for model, kwargs in [(target, {}), (offloaded, {}), (offloaded, {"assistant_model": drafter})]:
            timed(model, warm_up, **greedy, **kwargs)
        print("| prompts | whole target, s | offloaded alone, s | offloaded + drafter, s | speedup | tau | same |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        rows, first = [], 0
        for batch in batches:
            inputs = encode(tokenizer, batch, target.device)
            whole, whole_s = timed(target, inputs, **greedy)
            alone, alone_s = timed(offloaded, inputs, **greedy)
            drafted, drafted_s = timed(offloaded, inputs, **greedy, assistant_model=drafter)
            same = torch.equal(alone, whole) and torch.equal(drafted, whole)
            tau = drafter.last_generation_stats.mean_acceptance_length
            rows.append((whole_s, alone_s, drafted_s))
            number, first = f"{first}" if len(batch) == 1 else f"{first}-{first + len(batch) - 1}", first + len(batch)
            print(
                f"| {number} | {whole_s:.2f} | {alone_s:.2f} | {drafted_s:.2f} | {alone_s / drafted_s:.2f}x "
                f"| {tau:.2f} | {'yes' if same else 'NO'} |"
            )
        whole_s, alone_s, drafted_s = (sum(column) for column in zip(*rows))
        median = statistics.median(alone / drafted for _, alone, drafted in rows)
        print(
            f"| all | {whole_s:.2f} | {alone_s:.2f} | {drafted_s:.2f} | {alone_s / drafted_s:.2f}x "
            f"(median {median:.2f}x) | | |"
        )


if __name__ == "__main__":
    main()
