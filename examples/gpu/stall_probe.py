"""Why a forward on the lent GPU sometimes costs two or three times another: the same work, repeated, with what could
explain each repetition's time beside it.

The second GPU run (2026-11-26, docs/benchmarks.md, "Second run on a GPU") saw whole `generate()` calls in a slow
state: every drafter backbone of the call took about 45 ms instead of 3, verifications 73 instead of 27, and the
target alone 63 ms per token in one call and 21 in others, with the same +42-45 ms wherever a lap waited for the
device; at Qwen3-8B shapes, both runs timed the 17-token forward about 45 ms slower inside `generate()` than bare.
Each repetition here runs bare target forwards, `generate()` with the target alone, and `generate()` with the
drafter, and reports per target forward:

- wall time, and the process's CPU time over the same span (a host that is slow or shared runs the same ops in
  more CPU time; waiting for the device spins, so it counts as CPU time too);
- the device's time, from CUDA events around each target forward (no synchronization inside the timed span);
- the host's interruptions: involuntary context switches, and the cgroup's CPU throttling where the machine has one;
- new memory segments from the device (`cudaMalloc`) and allocation retries (each frees the cache's blocks after a
  synchronization), from the caching allocator's statistics;
- the GPU's SM clock before and after (through NVML, where `pynvml` imports).

A slow repetition whose device time is small points at the host, one whose device time grows with it at the GPU.
Random weights (times do not depend on them), the shapes of examples/gpu/cycle_costs.py. (The third run's repetitions
never slowed down: each repeats one prompt, so every attention shape after the first repetition is one cuDNN has
planned already, the cause the records point to since: docs/benchmarks.md, "The bf16 slow state"; lap_probe.py
measures it.) On a GPU:

    python examples/gpu/stall_probe.py --shape smollm2-135m --dtype bfloat16 --repeats 6

Here (a CPU) it runs at toy shapes, to check it end to end (no device time, clock or events there):

    python examples/gpu/stall_probe.py --shape tiny --dtype float32 --repeats 2 --new-tokens 8
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cycle_costs import build, model_parser  # noqa: E402

from hf_domino.cache_domino import CACHE_ARGUMENT, cache_argument  # noqa: E402
from hf_domino.cost_model_domino import synchronize  # noqa: E402

CGROUP_STAT = Path("/sys/fs/cgroup/cpu.stat")


def throttled_ms() -> float | None:
    """The cgroup's time throttled so far (cgroup v2), or None where there is none to read."""
    try:
        fields = dict(line.split() for line in CGROUP_STAT.read_text().splitlines())
        return int(fields["throttled_usec"]) / 1000
    except (OSError, KeyError, ValueError):
        return None


def sm_clock_mhz() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
    except Exception:  # no NVML here (a CPU, or no pynvml): the column says n/a
        return None


def allocator_counts(device: torch.device) -> tuple[int, int] | None:
    """(segments allocated from the device, allocation retries) so far, or None off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return stats.get("segment.all.allocated", 0), stats.get("num_alloc_retries", 0)


class ForwardTimer:
    """CUDA events around every forward of `model`: the device's time per forward, read after the span."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.on_cuda, self.events, self.count = device.type == "cuda", [], 0
        self.hooks = [
            model.register_forward_pre_hook(self.before),
            model.register_forward_hook(self.after),
        ]

    def before(self, module, args) -> None:
        self.count += 1
        if self.on_cuda:
            self.events.append([torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)])
            self.events[-1][0].record()

    def after(self, module, args, output) -> None:
        if self.on_cuda:
            self.events[-1][1].record()

    def device_ms(self) -> float | None:
        return sum(start.elapsed_time(end) for start, end in self.events) if self.on_cuda else None

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def measured(name: str, work, target, device: torch.device) -> dict:
    """Runs `work()` once and returns its row: per target forward, wall, CPU and device ms, and the host's
    interruptions over the span."""
    timer = ForwardTimer(target, device)
    synchronize(device)
    clock_before, throttled_before, allocator_before = sm_clock_mhz(), throttled_ms(), allocator_counts(device)
    usage_before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    try:
        work()
        synchronize(device)
    finally:
        timer.remove()
    wall, usage = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage.ru_utime + usage.ru_stime) - (usage_before.ru_utime + usage_before.ru_stime)
    throttled_after, device_ms, forwards = throttled_ms(), timer.device_ms(), max(timer.count, 1)
    allocator_after = allocator_counts(device)
    return {
        "work": name,
        "forwards": timer.count,
        "wall": 1000 * wall / forwards,
        "cpu": 1000 * cpu / forwards,
        "device": None if device_ms is None else device_ms / forwards,
        "switches": usage.ru_nivcsw - usage_before.ru_nivcsw,
        "throttled": None if throttled_before is None else throttled_after - throttled_before,
        "allocator": None
        if allocator_before is None
        else "/".join(str(after - before) for after, before in zip(allocator_after, allocator_before)),
        "clock": f"{clock_before}-{sm_clock_mhz()}" if clock_before is not None else None,
    }


@torch.no_grad()
def probe(target, drafter, device: torch.device, repeats: int, new_tokens: int, context_tokens: int) -> list[dict]:
    prompt = torch.randint(3, target.config.vocab_size, (1, context_tokens), device=device)
    layers = [i + 1 for i in drafter.config.target_layer_ids]

    def bare_forwards() -> None:  # one token at a time on a cache, as plain decoding's forwards are
        cache, token = getattr(target(prompt, use_cache=True), CACHE_ARGUMENT), prompt[:, -1:]
        for _ in range(new_tokens):
            target(token, use_cache=True, **cache_argument(cache), output_hidden_states=layers)

    work = {
        "bare forwards": bare_forwards,
        "generate(), target alone": lambda: target.generate(prompt, max_new_tokens=new_tokens, do_sample=False),
        "generate(), with the drafter": lambda: target.generate(
            prompt, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter, draft_policy="fixed"
        ),
    }
    for fn in work.values():  # warm: kernels chosen, caches allocated, the drafter's graphs captured
        fn()
    return [measured(name, fn, target, device) | {"repeat": r} for r in range(repeats) for name, fn in work.items()]


def table(rows: list[dict]) -> str:
    def cell(value, digits: int = 1) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = [
        "| repeat | work | target forwards | wall ms / forward | CPU ms / forward | device ms / forward "
        "| involuntary switches | throttled ms | cudaMalloc / retries | SM clock MHz |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['repeat']} | {row['work']} | {row['forwards']} | {cell(row['wall'])} | {cell(row['cpu'])} "
            f"| {cell(row['device'], 2)} | {row['switches']} | {cell(row['throttled'])} | {cell(row['allocator'])} "
            f"| {cell(row['clock'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = model_parser(__doc__, "smollm2-135m")
    parser.add_argument("--repeats", type=int, default=6, help="repetitions of the three kinds of work")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per repetition")
    parser.add_argument("--context-tokens", type=int, default=64, help="prompt length")
    parser.add_argument("--threads", type=int, default=8, help="torch threads (the benches use 8 on the GPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    target, drafter = build(args.shape, getattr(torch, args.dtype), device)
    rows = probe(target, drafter, device, args.repeats, args.new_tokens, args.context_tokens)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.shape}, {args.dtype}, {name}, torch {torch.__version__}, torch threads: {args.threads}, "
          f"{args.new_tokens} new tokens after {args.context_tokens}\n")  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
