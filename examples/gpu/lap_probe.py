"""Where a drafting cycle's time goes on the GPU, with the bench's own target, drafter, prompt and options.

The third GPU run (2026-11-27, docs/benchmarks.md, "Third run on a GPU") found the bf16 slowness of the second one
again, and sharper: inside each `hf-domino bench` process, every drafting cycle's `backbone` lap took 3-5 ms for the
first 8-12 cycles, then 40-49 ms for every later cycle of every later call, and verifications jumped between ~27 and
~70 ms; fp32 stayed at 3 ms. The random-weight Qwen3 of `stall_probe.py` never entered that state. This runs the
bench's method on the first MT-Bench prompt with the real SmolLM2 target and the shipped drafter (`run_method`, the
bench's own call), call after call in one process, and prints for each call its laps: the first cycles' and the
later ones' median backbone lap, the verify lap, the process's CPU time against wall time, and its thread count. Variants
(eager head, no draft vocabulary, no timings, the target alone) follow one another, so a state that sets in once and stays
shows as such. Beside it, the GPU's P-state, clocks, power and throttle reasons, and the compute processes on it, are
sampled (`nvidia-smi`); at the end one call of the bench's method is profiled: host Python functions by own time,
and torch ops by host and by device time. On a GPU:

    python examples/gpu/lap_probe.py --dtype bfloat16

Here (a CPU) it runs the same calls, small, to check it end to end (no device telemetry):

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

import torch

from hf_domino.assets import encode_chat, load_drafter, load_mtbench, load_target
from hf_domino.measure import run_method

BENCH_METHOD = "domino_vocab_k16@triton+graph"  # the bf16 stage's whole blocks, the head fused with its graph
# (method, timings): the bench reads a clock after each step of a cycle, waiting for the device each time; the
# random-weight probe, which never slowed down, read none. Its wall time per forward says whether the waits matter.
VARIANTS = (
    (BENCH_METHOD, True),
    ("domino_vocab_k16@eager", True),
    ("domino_k16@triton+graph", True),
    (BENCH_METHOD, False),
    ("target", True),
    (BENCH_METHOD, True),
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


def describe_call(method: str, generation, cpu_seconds: float, started: float) -> str:
    """One row: when the call started, its wall and CPU time per target forward, and its laps."""
    forwards = max(1, len(generation.acceptance_lengths))
    laps = generation.timings or {}
    backbone, verify = laps.get("backbone", []), laps.get("verify", [])
    slow = sum(lap > 0.02 for lap in backbone)
    return (
        f"| {started:.1f} | {method} | {forwards} | {1000 * generation.seconds / forwards:.1f} "
        f"| {1000 * cpu_seconds / forwards:.1f} | {median_ms(backbone[:8])} | {median_ms(backbone[8:])} "
        f"| {slow}/{len(backbone)} | {median_ms(verify)} | {threading.active_count()}/{len(os.listdir('/proc/self/task'))} |"
    )


def profile_call(call, rows: int, on_cuda: bool) -> str:
    """Host Python functions by own time, then torch ops by host time and (on CUDA) by device time, for one call."""
    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile()
    host.runcall(call)
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(rows)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as trace:
        call()
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
    prompt = encode_chat(tokenizer, load_mtbench(1)[0])
    on_cuda = target.device.type == "cuda"
    print(f"{args.dtype}, {torch.cuda.get_device_name() if on_cuda else 'cpu'}, torch {torch.__version__}, "
          f"{args.threads} torch threads, {prompt.shape[1]} prompt tokens, {args.new_tokens} new tokens per call\n")  # fmt: skip
    # Off CUDA the fused head does not run (without Triton's interpreter): the same calls with the eager head.
    variants = [
        (method if on_cuda else method.replace("@triton+graph", "@eager"), timed) for method, timed in VARIANTS
    ]
    print(
        "| s since start | method | target forwards | wall ms / forward | CPU ms / forward | backbone, first 8 "
        "| backbone, later | backbone > 20 ms | verify | Python / OS threads |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    # The warm-up (kernels compiled, graphs captured, as the bench warms up) is printed too: the second run's state
    # set in within a process's first calls.
    calls = [(method, timed, args.warmup_tokens, " (warm-up)") for method, timed in dict.fromkeys(variants)]
    calls += [(method, timed, args.new_tokens, "") for _ in range(args.rounds) for method, timed in variants]
    start = time.perf_counter()
    for method, timed, new_tokens, label in calls:
        began, cpu = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        generation = run_method(method, target, drafter, prompt, new_tokens, record_timings=timed)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_seconds = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
        name = method + ("" if timed or method == "target" else " (no timings)") + label
        print(describe_call(name, generation, cpu_seconds, began), flush=True)
    method = variants[0][0]
    print(f"\n{method}, one call profiled:\n")
    print(profile_call(lambda: run_method(method, target, drafter, prompt, args.new_tokens), args.rows, on_cuda))
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
