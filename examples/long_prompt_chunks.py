"""A long prompt read whole or in chunks (`prefill_chunk_size`), by the target alone and with the drafter: each call's
peak memory and time.

The prompt: MT-Bench questions joined until it holds `--prompt-tokens` tokens, then a request to answer the last one
(SmolLM2-135M reads up to 8,192). The four calls run interleaved, their order rotating, after one warm-up round.
Before each call the heap's free pages go back to the system (`malloc_trim`) and the process's peak resident memory
(VmHWM) is reset (`/proc/self/clear_refs`; glibc Linux only), so the peak reported is the call's own, above what the
process held before it (median over the rounds). Every drafted
output is asserted identical to the target alone's read in the same chunks.

    python examples/long_prompt_chunks.py --prompt-tokens 4000 --chunk 512 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from hf_domino.assets import load_drafter, load_target
from hf_domino.prompt_sets import load_mtbench

STATUS = Path("/proc/self/status")


def resident_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS: now; VmHWM: the peak since the last reset)."""
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) / 1024


def long_prompt(tokenizer, tokens: int) -> torch.Tensor:
    """MT-Bench's first-turn questions joined to about `tokens` tokens, in the chat template."""
    questions = [messages[0]["content"] for messages in load_mtbench(limit=80)]
    text, index = "", 0
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += questions[index % len(questions)] + "\n\n"
        index += 1
    request = text + "Answer the last question above."
    messages = [{"role": "user", "content": request}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def measured_call(target, prompt: torch.Tensor, options: dict) -> tuple[torch.Tensor, float, float]:
    """(output, seconds, peak MiB above the resident memory before the call)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hands the heap's free pages back: else a call reuses them unseen
    before = resident_mib("VmRSS")
    STATUS.with_name("clear_refs").write_text("5")  # resets VmHWM to the current resident memory
    start = time.perf_counter()
    output = target.generate(prompt, **options)
    return output, time.perf_counter() - start, resident_mib("VmHWM") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target()
    drafter = load_drafter().to(target.dtype)
    prompt = long_prompt(tokenizer, args.prompt_tokens)
    plain = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    calls = {
        "target alone, whole": dict(plain),
        f"target alone, chunks of {args.chunk}": dict(plain, prefill_chunk_size=args.chunk),
        "drafter, whole": dict(plain, assistant_model=drafter),
        f"drafter, chunks of {args.chunk}": dict(plain, assistant_model=drafter, prefill_chunk_size=args.chunk),
    }
    names = list(calls)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, torch.Tensor] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            outputs[name], took, peak = measured_call(target, prompt, calls[name])
            if round_:
                seconds[name].append(took)
                peaks[name].append(peak)
    for alone, drafted in ((names[0], names[2]), (names[1], names[3])):
        assert torch.equal(outputs[drafted], outputs[alone]), (drafted, alone)
    print(f"prompt: {prompt.shape[1]} tokens; {args.max_new_tokens} new; {args.rounds} rounds, medians; "
          f"{args.threads} threads; torch {torch.__version__}")  # fmt: skip
    print("| call | peak above resident (MiB) | seconds | against the target alone read alike |")
    print("| --- | ---: | ---: | ---: |")
    for index, name in enumerate(names):
        baseline = statistics.median(seconds[names[index % 2]])
        took = statistics.median(seconds[name])
        print(f"| {name} | {statistics.median(peaks[name]):.0f} | {took:.2f} | {baseline / took:.2f}x |")


if __name__ == "__main__":
    main()
