"""Where a drafting cycle's time goes on the GPU, with the bench's own target, drafter, prompts and options: is the
bf16 slow state cuDNN's attention planning every new shape?

The third GPU run (2026-11-27, docs/benchmarks.md, "Third run on a GPU") found the bf16 slowness of the second one
again: inside each `hf-domino bench` process, every drafting cycle's `backbone` lap took 3-5 ms for the first 8-12
cycles (the lengths the warm-up had met), then 40-49 ms, and the target alone's first call ran 56 ms per token, its
later ones 26-29; fp32 never slowed, nor did `stall_probe.py`, which repeats one prompt. That run's profile shows
bf16 attention running cuDNN's kernels (`aten::_cudnn_attention_forward`): PyTorch's CUDA 13 builds try cuDNN first
on Hopper, and cuDNN builds an execution plan for every new (query length, key length) before it runs it. A
drafting call meets a new pair at every cycle, which is why `generate()` with a drafter now leaves cuDNN out in half
precision (`attention_kernels_domino.drafting_attention_kernels`). This checks that, A against B on the same prompts: each
round takes a new MT-Bench prompt (new lengths) through whole blocks with cuDNN left out (the default) and allowed
(`domino_cudnn_attention=True`, what the third run did), the user's default method, and the target alone with and
without cuDNN; for each call, its laps (the first cycles' and the later ones' median backbone lap, the verify lap),
the process's CPU time against wall time, and its thread count. Then one call of each whole-block variant, on a
prompt none has seen, is profiled (host Python functions by own time, torch ops by host and by device time: plans
built show as host time in `aten::_cudnn_attention_forward`). Beside it, the GPU's P-state, clocks, power and throttle
reasons, and the compute processes on it, are sampled (`nvidia-smi`). On a GPU:

    python examples/gpu/lap_probe.py --dtype bfloat16

Here (a CPU) it runs the same calls, small, to check it end to end (no device telemetry; no cuDNN to leave out):

    python examples/gpu/lap_probe.py --dtype float32 --new-tokens 4 --warmup-tokens 2 --rounds 1 --rows 8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from typing import NamedTuple

import torch

from hf_domino.assets import encode_chat, load_drafter, load_target
from hf_domino.measure import run_method
from hf_domino.prompt_sets import load_mtbench

BENCH_METHOD = "domino_vocab_k16@triton+graph"  # the bf16 stage's whole blocks, the head fused with its graph


class Variant(NamedTuple):
    method: str  # a bench method (`hf_domino.measure.parse_method`)
    cudnn: bool = False  # a drafting call with cuDNN's attention allowed (`domino_cudnn_attention=True`)
    timed: bool = True  # per-cycle laps: a clock read after each step, waiting for the device each time


VARIANTS = (
    Variant(BENCH_METHOD),
    Variant(BENCH_METHOD, cudnn=True),
    Variant("domino_vocab_lookup"),
    Variant("target"),  # the process's own kernels: cuDNN's first where PyTorch prefers them
    Variant("target_no_cudnn"),
    Variant(BENCH_METHOD, timed=False),
)
# Why the clocks are below their maximum is `clocks_event_reasons` in newer drivers, `clocks_throttle_reasons` before.
TELEMETRY = tuple(
    f"timestamp,pstate,clocks.sm,clocks.mem,power.draw,utilization.gpu,clocks_{reasons}_reasons.active"
    for reasons in ("event", "throttle")
)


def start_telemetry(path: str) -> tuple[subprocess.Popen, str] | None:
    """`nvidia-smi` sampling the GPU every 200 ms into `path`, with the fields this driver knows; None where there is
    no nvidia-smi or it knows neither field list."""
    if shutil.which("nvidia-smi") is None:
        return None
    for fields in TELEMETRY:
        query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
        if subprocess.run(query, capture_output=True).returncode == 0:
            with open(path, "w") as out:
                return subprocess.Popen([*query, "-lms", "200"], stdout=out), fields
    return None


def summarize_telemetry(samples: list[str], fields: str) -> str:
    """The samples where the GPU's P-state, clocks or clock event reasons changed, and the range of its power and
    utilization over the whole run."""
    lines = [f"\nGPU telemetry ({len(samples)} samples, every 200 ms: {fields}); where the state changed:"]
    previous, power, busy = None, [], []
    for sample in samples:
        fields = [field.strip() for field in sample.split(",")]
        if len(fields) != 7:
            continue
        state = (fields[1], fields[2], fields[3], fields[6])
        if state != previous:
            lines.append(sample)
            previous = state
        power.append(leading_number(fields[4]))
        busy.append(leading_number(fields[5]))
    power, busy = [x for x in power if x is not None], [x for x in busy if x is not None]
    if power and busy:
        lines.append(f"power draw {min(power):.0f}-{max(power):.0f} W; utilization {min(busy):.0f}-{max(busy):.0f}%")
    return "\n".join(lines)


def leading_number(field: str) -> float | None:
    """`"123.45 W"` -> 123.45; None for what nvidia-smi could not read (`[N/A]`)."""
    try:
        return float(field.split()[0])
    except (IndexError, ValueError):
        return None


def median_ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f}" if values else "-"


def describe_call(method: str, generation, cpu_seconds: float, started: float, prompt: int) -> str:
    """One row: when the call started, its prompt, its wall and CPU time per target forward, and its laps."""
    forwards = max(1, len(generation.acceptance_lengths))
    laps = generation.timings or {}
    backbone, verify = laps.get("backbone", []), laps.get("verify", [])
    slow = sum(lap > 0.02 for lap in backbone)
    return (
        f"| {started:.1f} | {prompt} | {method} | {forwards} | {1000 * generation.seconds / forwards:.1f} "
        f"| {1000 * cpu_seconds / forwards:.1f} | {median_ms(backbone[:8])} | {median_ms(backbone[8:])} "
        f"| {slow}/{len(backbone)} | {median_ms(verify)} | {threading.active_count()}/{len(os.listdir('/proc/self/task'))} |"
    )


def profile_calls(host_call, op_call, rows: int, on_cuda: bool) -> str:
    """Host Python functions by own time in `host_call()`, then torch ops by host time and (on CUDA) by device time in
    `op_call()`: two calls, so that each can meet lengths the process has not met before."""
    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile()
    host.runcall(host_call)
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(rows)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as trace:
        op_call()
    events = trace.key_averages()
    report = text.getvalue() + "\n" + events.table(sort_by="self_cpu_time_total", row_limit=rows)
    if on_cuda:
        report += "\n" + events.table(sort_by="self_device_time_total", row_limit=rows)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens per call")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the variants")
    parser.add_argument("--warmup-tokens", type=int, default=16, help="tokens of each variant's first call")
    parser.add_argument("--threads", type=int, default=8, help="torch threads (the GPU benches use 8)")
    parser.add_argument("--rows", type=int, default=25, help="rows of each profile table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    telemetry_path = os.path.join(tempfile.mkdtemp(), "gpu.csv")
    telemetry = start_telemetry(telemetry_path)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target("smollm2", dtype=dtype)
    drafter = load_drafter(dtype=dtype).to(target.device)
    # prompt 0 warms every variant up, then one new prompt per round, and the last two for the profiles
    prompts = [encode_chat(tokenizer, messages) for messages in load_mtbench(args.rounds + 3)]
    on_cuda = target.device.type == "cuda"
    print(f"{args.dtype}, {torch.cuda.get_device_name() if on_cuda else 'cpu'}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, {args.threads} torch threads, prompts of "
          f"{[p.shape[1] for p in prompts]} tokens, {args.new_tokens} new tokens per call\n")  # fmt: skip
    # Off CUDA the fused head does not run (without Triton's interpreter): the same calls with the eager head.
    variants = [
        v._replace(method=v.method if on_cuda else v.method.replace("@triton+graph", "@eager")) for v in VARIANTS
    ]

    def call(variant: Variant, prompt: torch.Tensor, new_tokens: int):
        if variant.cudnn:  # read by generate() with a drafter, as a keyword argument would be
            target.generation_config.domino_cudnn_attention = True
        try:
            return run_method(variant.method, target, drafter, prompt, new_tokens, record_timings=variant.timed)
        finally:
            vars(target.generation_config).pop("domino_cudnn_attention", None)

    print(
        "| s since start | prompt | method | target forwards | wall ms / forward | CPU ms / forward | backbone, first 8 "
        "| backbone, later | backbone > 20 ms | verify | Python / OS threads |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    calls = [(variant, 0, args.warmup_tokens, " (warm-up)") for variant in dict.fromkeys(variants)]
    calls += [(variant, r, args.new_tokens, "") for r in range(1, args.rounds + 1) for variant in variants]
    start = time.perf_counter()
    for variant, p, new_tokens, label in calls:
        began, cpu = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        generation = call(variant, prompts[p], new_tokens)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_seconds = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
        name = variant.method + (" (cuDNN allowed)" if variant.cudnn else "")
        name += (
            "" if variant.timed or not variant.method.startswith(("domino", "dflash")) else " (no timings)"
        ) + label
        print(describe_call(name, generation, cpu_seconds, began, p), flush=True)
    for variant in variants[:2]:
        name = variant.method + (" (cuDNN allowed)" if variant.cudnn else "")
        print(f"\n{name}, profiled on prompts no call has met:\n")
        host_call, op_call = (lambda v=variant, p=p: call(v, p, args.new_tokens) for p in prompts[-2:])
        print(profile_calls(host_call, op_call, args.rows, on_cuda))
    if telemetry is None and on_cuda:
        print("\nNo GPU telemetry: nvidia-smi is missing or knows neither list of fields.")
    if telemetry is not None:
        sampler, fields = telemetry
        sampler.terminate()
        sampler.wait()
        print(summarize_telemetry(open(telemetry_path).read().splitlines(), fields))
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
            capture_output=True, text=True,
        )  # fmt: skip
        print(f"\nCompute processes on the GPU (this one is {os.getpid()}):\n{apps.stdout}")


if __name__ == "__main__":
    main()
