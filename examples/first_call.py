"""A process's first `generate()` call, as a user's script makes it: the README's steps (load the SmolLM2 target and
the shipped drafter, `prepare_for_cpu_decoding`), then one call, timed, in a fresh process per call. Each case runs
the target alone and with the drafter in alternating order, `--repeats` times; prints the medians, their ratio and
what loading and preparing took. `--batch-size N`: the set's first N prompts as one left-padded batch (the haiku N
times). `--device cuda`: the same on a GPU (where preparing changes nothing, so the first call measures the verify
costs and captures the fused head's CUDA graph). `--compile`: `prepare_for_cpu_decoding(..., compile=True)`, so the
first call also compiles the target's forward (set TORCHINDUCTOR_CACHE_DIR to an empty folder for a machine that never
compiled it). docs/benchmarks.md, "A process's first call" and "Compiled on a CPU", quotes it:

    python examples/first_call.py --repeats 3
    python examples/first_call.py --repeats 3 --batch-size 8 --cases mtbench humaneval
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python examples/first_call.py --repeats 1 --cases mtbench --compile

Later calls in a process are what `hf-domino bench` and `examples/generate_ab.py` measure (after a warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {"haiku": 64, "mtbench": 128, "humaneval": 128}  # prompt -> max_new_tokens
HAIKU = [{"role": "user", "content": "Write a haiku about dominoes."}]  # the README's prompt


def one_call(prompt: str, with_drafter: bool, threads: int, rows: int, device: str, compile: bool) -> None:
    """In a fresh process: the README's set-up, then one greedy call; prints its seconds and the set-up's."""
    import torch

    import hf_domino
    from hf_domino.assets import chat_token_ids, load_drafter, load_target, pad_token_id
    from hf_domino.measure_batch import left_padded_batch
    from hf_domino.prompt_sets import load_prompts

    torch.set_num_threads(threads)
    start = time.perf_counter()
    target, tokenizer = load_target("smollm2", device=device)
    drafter = load_drafter().to(target.device, target.dtype)
    hf_domino.prepare_for_cpu_decoding(target, drafter, batch_size=rows, compile=compile)  # on a GPU: changes nothing
    setup = time.perf_counter() - start
    conversations = [HAIKU] * rows if prompt == "haiku" else load_prompts(prompt, rows)
    prompts = [chat_token_ids(tokenizer, messages) for messages in conversations]
    pad = pad_token_id(target, tokenizer)
    batch = {name: tensor.to(target.device) for name, tensor in left_padded_batch(tokenizer, prompts, pad).items()}
    extra = {"assistant_model": drafter} if with_drafter else {}
    start = time.perf_counter()
    target.generate(**batch, max_new_tokens=CASES[prompt], do_sample=False, **extra)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    print(f"{time.perf_counter() - start:.4f} {setup:.4f}")


def timed_in_fresh_process(prompt: str, with_drafter: bool, args: argparse.Namespace) -> tuple[float, float]:
    command = [sys.executable, __file__, "--child", prompt, "--threads", str(args.threads)]
    command += ["--batch-size", str(args.batch_size), "--device", args.device] + (
        ["--compile"] if args.compile else []
    )
    output = subprocess.run(
        command + (["--with-drafter"] if with_drafter else []), capture_output=True, text=True, check=True
    ).stdout
    call, setup = output.split()[-2:]
    return float(call), float(setup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--compile", action="store_true", help="prepare_for_cpu_decoding(..., compile=True)")
    parser.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--with-drafter", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_call(args.child, args.with_drafter, args.threads, args.batch_size, args.device, args.compile)
        return
    for prompt in args.cases:
        seconds: dict[bool, list[float]] = {False: [], True: []}
        setups: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(args.repeats):
            for with_drafter in (False, True) if repeat % 2 == 0 else (True, False):
                call, setup = timed_in_fresh_process(prompt, with_drafter, args)
                seconds[with_drafter].append(call)
                setups[with_drafter].append(setup)
        alone, drafted = statistics.median(seconds[False]), statistics.median(seconds[True])
        print(
            f"{prompt} ({args.batch_size} x {CASES[prompt]} tokens): target alone {alone:.2f} s, with the drafter {drafted:.2f} s "
            f"({', '.join(f'{s:.2f}' for s in seconds[True])}): {alone / drafted:.2f}x; load and prepare "
            f"{statistics.median(setups[True]):.1f} s"
        )


if __name__ == "__main__":
    main()
