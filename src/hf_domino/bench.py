"""`hf-domino bench`: speculative decoding methods against the target alone, interleaved per prompt in one process.

Methods:

- `target`: the target's own `generate()` (greedy or sampling), the baseline every speedup is measured against;
- `prompt_lookup`: transformers' n-gram prompt lookup (`prompt_lookup_num_tokens`), a drafter-free peer;
- `dflash`: `generate(assistant_model=drafter)` with the Domino head switched off (DFlash drafting, same weights);
- `domino`: the same with the head on;
- `manual`: a minimal hand-written greedy draft/verify loop (`manual_generate`) with the same drafter and the
  target's `DynamicCache`, to price what transformers' assisted-decoding loop costs around the same work.

Acceptance lengths are measured the same way for every method, from the target's forward calls: the tokens each
target forward after the prefill added to the sequence (accepted drafts plus the target's own token).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers.cache_utils import DynamicCache

from . import assets
from .modeling_domino import DominoForSpeculation, TargetModules

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

METHODS = ("target", "prompt_lookup", "dflash", "domino", "manual")
DRAFTER_METHODS = ("dflash", "domino", "manual")
GREEDY_ONLY_METHODS = ("manual",)
# Per-cycle pieces, in cycle order as plotted: draft (backbone, base logits, head rollout), then target verify.
TIMING_KEYS = ("backbone", "lm_head", "head", "verify")
SHIPPED_DRAFTER = Path(__file__).parent / "checkpoints" / "smollm2-135m-instruct-domino"
PLOT_FILES = {"acceptance": "bench_acceptance.png", "speedup": "bench_speedup.png", "latency": "bench_latency.png"}


# ------------------------------------------------------------------------------------------------------- loading
def load_drafter(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32) -> DominoForSpeculation:
    """Loads a drafter folder (default: the SmolLM2 drafter shipped in the package), with a clear error if absent."""
    path = Path(path) if path is not None else SHIPPED_DRAFTER
    if not (path / "config.json").is_file():
        shipped = " (the drafter shipped with hf-domino)" if path == SHIPPED_DRAFTER else ""
        raise FileNotFoundError(
            f"No drafter checkpoint at {path}{shipped}: expected config.json and model.safetensors there. Train one "
            "with `hf-domino train` or point --drafter at a drafter folder."
        )
    return DominoForSpeculation.from_pretrained(path, dtype=dtype).eval()


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> torch.LongTensor:
    """Chat-templated prompt ids `[1, n]`, generation prompt included."""
    encoding = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoding["input_ids"]


def eos_token_ids(target: PreTrainedModel) -> list[int]:
    eos = target.generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def generation_kwargs(target: PreTrainedModel, max_new_tokens: int, temperature: float) -> dict[str, Any]:
    """The sampling settings shared by every method: plain greedy, or plain temperature sampling (no top-k/p)."""
    eos = eos_token_ids(target)
    pad = target.generation_config.pad_token_id
    kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": pad if pad is not None else (eos or [0])[0]}
    if temperature > 0:
        return kwargs | {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    return kwargs | {"do_sample": False}


# ------------------------------------------------------------------------------------------- measuring a generation
@dataclass
class Generation:
    """One method on one prompt: its new tokens, wall time, tokens per target forward, and per-cycle timings."""

    new_tokens: list[int]
    seconds: float
    acceptance_lengths: list[int]
    timings: dict[str, list[float]] | None = None


@contextlib.contextmanager
def record_target_forwards(target: PreTrainedModel) -> Iterator[list[int]]:
    """Records the target's cache length at the start of each of its forward calls.

    Every decoding loop here keeps all verified tokens but the last one in the target cache, so the cache length at
    forward i + 1 minus the one at forward i is what forward i added; this measures acceptance identically for the
    target alone, prompt lookup, the Domino generator and the manual loop, without reaching into any of them.
    """
    cache_lengths: list[int] = []

    def pre_hook(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        cache_lengths.append(int(cache.get_seq_length()) if cache is not None else 0)

    handle = target.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield cache_lengths
    finally:
        handle.remove()


def acceptance_from_cache_lengths(cache_lengths: Sequence[int], final_length: int) -> list[int]:
    """Tokens added by each target forward after the prefill, from `record_target_forwards`' cache lengths.

    The first forward is the prefill (cache empty); at every later one the cache holds all verified tokens but the
    last, so the sequence length at the start of forward i is `cache_lengths[i] + 1`.
    """
    starts = [length + 1 for length in cache_lengths[1:]]
    return [end - start for start, end in zip(starts, [*starts[1:], final_length])]


class Stopwatch:
    """Adds the time since the previous tick to `timings[name]`; does nothing when `timings` is None."""

    def __init__(self, timings: dict[str, list[float]] | None, device: torch.device):
        self.timings, self.device = timings, device
        self.clock = time.perf_counter()

    def tick(self, name: str | None = None) -> None:
        if self.timings is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if name is not None:
            self.timings.setdefault(name, []).append(now - self.clock)
        self.clock = now


# ------------------------------------------------------------------------------------------------------ manual loop
def _context_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def draft_greedy(
    drafter: DominoForSpeculation,
    modules: TargetModules,
    tokens: torch.LongTensor,
    context: torch.Tensor,
    cache: DynamicCache,
    context_length: int,
    num_drafts: int,
    stopwatch: Stopwatch,
) -> torch.LongTensor:
    """One greedy block after `tokens[:, -1]`; `context` holds the features of the tokens not yet in `cache`."""
    config, device = drafter.config, drafter.device
    anchor_position = context_length + context.shape[1]
    position_ids = torch.arange(context_length, anchor_position + config.block_size, device=device)[None]
    block_embeds = drafter.embed_block(modules, tokens)
    block_hidden = drafter(block_embeds, context.to(device), position_ids, past_key_values=cache)
    stopwatch.tick("backbone")
    draft_hidden = drafter.draft_hidden_states(block_hidden)[:, :num_drafts]
    base_logits = modules.logits(draft_hidden).float()
    stopwatch.tick("lm_head")
    if drafter.head_active:
        draft_ids, _ = drafter.rollout(draft_hidden, base_logits, tokens, modules)
    else:
        draft_ids = base_logits.argmax(dim=-1)
    stopwatch.tick("head")
    return draft_ids.to(tokens.device)


@torch.inference_mode()
def manual_generate(
    target: PreTrainedModel,
    drafter: DominoForSpeculation,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    timings: dict[str, list[float]] | None = None,
) -> torch.LongTensor:
    """Greedy speculative decoding without transformers' generation loop: draft a block, verify, keep the prefix.

    Returns `input_ids` followed by the new tokens (at most `max_new_tokens`, cut after the first EOS), which are
    exactly the target's own greedy tokens. `timings` (if given) receives per-cycle `backbone`, `lm_head`, `head`
    and `verify` seconds, the split `DominoGenerationStats.timings` reports for `generate()`.
    """
    config, modules = drafter.config, TargetModules.from_target(target)
    layer_ids = config.target_layer_ids
    keep_layers = [i + 1 for i in layer_ids]  # only these hidden states are returned
    max_length = input_ids.shape[1] + max_new_tokens
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=input_ids.device)
    target_cache, drafter_cache = DynamicCache(config=target.config), DynamicCache()
    stopwatch = Stopwatch(timings, drafter.device)

    outputs = target(input_ids, past_key_values=target_cache, output_hidden_states=keep_layers, logits_to_keep=1)
    tokens = torch.cat([input_ids, outputs.logits[:, -1:].argmax(dim=-1)], dim=-1)
    context = _context_features(outputs.hidden_states, layer_ids)  # every prompt token
    context_length = 0  # tokens whose drafter keys/values are in `drafter_cache`
    stopwatch.tick()
    block_drafts = drafter.drafts_per_block
    while tokens.shape[1] < max_length and not bool(torch.isin(tokens[0, -1], eos)):
        num_drafts = min(block_drafts, max_length - tokens.shape[1] - 1)
        draft_ids = tokens[:, :0]
        if num_drafts > 0:
            draft_ids = draft_greedy(
                drafter, modules, tokens, context, drafter_cache, context_length, num_drafts, stopwatch
            )
            context_length += context.shape[1]
        verify_ids = torch.cat([tokens[:, -1:], draft_ids], dim=-1)
        outputs = target(verify_ids, past_key_values=target_cache, output_hidden_states=keep_layers)
        predicted = outputs.logits.argmax(dim=-1)
        num_matches = int((draft_ids == predicted[:, :-1]).cumprod(dim=-1).sum())
        accepted = predicted[:, : num_matches + 1]  # matched drafts equal the target's tokens, plus the bonus token
        eos_positions = torch.isin(accepted[0], eos).nonzero()
        if eos_positions.numel():
            accepted = accepted[:, : int(eos_positions[0]) + 1]
        # Drop the rejected drafts: the cache keeps every verified token but the newest (the next anchor).
        target_cache.crop(num_matches - draft_ids.shape[1])
        context = _context_features(outputs.hidden_states, layer_ids)[:, : num_matches + 1]
        tokens = torch.cat([tokens, accepted], dim=-1)[:, :max_length]
        stopwatch.tick("verify")
    return tokens


# ---------------------------------------------------------------------------------------------------- one method
def run_method(
    method: str,
    target: PreTrainedModel,
    drafter: DominoForSpeculation | None,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    prompt_lookup_tokens: int = 10,
    record_timings: bool = True,
) -> Generation:
    """Generates once with `method` and measures it (wall time around the whole call, prefill included)."""
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; choose among {', '.join(METHODS)}.")
    if method in DRAFTER_METHODS and drafter is None:
        raise ValueError(f"Method {method!r} needs a drafter.")
    if method in GREEDY_ONLY_METHODS and temperature > 0:
        raise ValueError(f"Method {method!r} is greedy only; run it at --temperature 0.")
    if method == "domino" and not drafter.config.has_domino_head:
        raise ValueError("Method 'domino' needs a drafter with a Domino head (projector_type='domino').")
    input_ids = input_ids.to(target.device)
    drafter_mode = contextlib.nullcontext()
    if method in DRAFTER_METHODS:
        drafter_mode = _drafting_mode(drafter, head=method != "dflash", record_timings=record_timings)
    timings = None
    with drafter_mode, record_target_forwards(target) as cache_lengths:
        start = time.perf_counter()
        if method == "manual":
            timings = {} if record_timings else None
            output = manual_generate(target, drafter, input_ids, max_new_tokens, eos_token_ids(target), timings)
        else:
            kwargs = generation_kwargs(target, max_new_tokens, temperature)
            if method == "prompt_lookup":
                kwargs["prompt_lookup_num_tokens"] = prompt_lookup_tokens
            elif method in DRAFTER_METHODS:
                kwargs["assistant_model"] = drafter
            output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        if target.device.type == "cuda":
            torch.cuda.synchronize(target.device)
        seconds = time.perf_counter() - start
    if method in DRAFTER_METHODS and method != "manual" and record_timings:
        timings = {key: list(values) for key, values in (drafter.last_generation_stats.timings or {}).items()}
    return Generation(
        new_tokens=output[0, input_ids.shape[1] :].tolist(),
        seconds=seconds,
        acceptance_lengths=acceptance_from_cache_lengths(cache_lengths, output.shape[1]),
        timings=timings,
    )


@contextlib.contextmanager
def _drafting_mode(drafter: DominoForSpeculation, head: bool, record_timings: bool) -> Iterator[None]:
    # `manual` follows the drafter's head setting too, so that it reproduces `domino` (or DFlash for DFlash drafters).
    head_switch = drafter.domino_head(head) if drafter.config.has_domino_head else contextlib.nullcontext()
    previous, drafter.record_timings = drafter.record_timings, record_timings
    try:
        with head_switch:
            yield
    finally:
        drafter.record_timings = previous


@torch.inference_mode()
def measure_forward_ms(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    lengths: Sequence[int],
    drafter: DominoForSpeculation | None = None,
    repeats: int = 5,
) -> dict[int, float]:
    """Median ms of one target forward over `length` new tokens after `input_ids` is cached, for each length.

    This is the verify cost of a block of `length - 1` drafts (1 = plain decoding), with the drafter's hidden-state
    selection when a drafter is given; it decides how many tokens per forward a drafter must reach to pay off.
    """
    input_ids = input_ids.to(target.device)
    hidden_states = [i + 1 for i in drafter.config.target_layer_ids] if drafter is not None else False
    cache = DynamicCache(config=target.config)
    target(input_ids, past_key_values=cache, logits_to_keep=1)
    costs = {}
    for length in lengths:
        block = input_ids[:, -1:].expand(1, length)  # token values do not change the cost
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            target(block, past_key_values=cache, output_hidden_states=hidden_states)
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            samples.append(1000 * (time.perf_counter() - start))
            cache.crop(-length)
        costs[length] = statistics.median(samples)
    return costs


# ----------------------------------------------------------------------------------------------------- benchmark
@dataclass
class BenchSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    prompt_lookup_tokens: int = 10
    warmup_tokens: int = 16


@dataclass
class BenchResult:
    methods: list[str]
    settings: BenchSettings
    # records[method][prompt index]
    records: dict[str, list[Generation]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    title: str = ""  # plot subtitle, e.g. "(mtbench, T=0)"
    # Median ms of one target forward by the number of tokens it takes, with the first prompt cached.
    forward_ms: dict[int, float] = field(default_factory=dict)


def run_benchmark(
    target: PreTrainedModel,
    drafter: DominoForSpeculation | None,
    prompts: Sequence[torch.LongTensor],
    methods: Sequence[str],
    settings: BenchSettings | None = None,
    progress: bool = True,
) -> BenchResult:
    """Runs every method on every prompt, interleaved per prompt, after one short warm-up generation per method.

    The method order rotates from prompt to prompt so that no method always runs right after the same other one
    (caches, CPU frequency). With sampling, each (prompt, method) pair is seeded with the same seed.
    """
    from tqdm.auto import tqdm

    settings = settings or BenchSettings()
    methods = list(methods)
    result = BenchResult(methods=methods, settings=settings, records={method: [] for method in methods})
    if not prompts:
        return result

    def generate(method: str, input_ids: torch.LongTensor, max_new_tokens: int, seed: int) -> Generation:
        torch.manual_seed(seed)
        return run_method(
            method,
            target,
            drafter,
            input_ids,
            max_new_tokens,
            temperature=settings.temperature,
            prompt_lookup_tokens=settings.prompt_lookup_tokens,
        )

    for method in methods:  # warm-up: allocator, kernels, lazy imports
        generate(method, prompts[0], settings.warmup_tokens, settings.seed)
    drafts = [drafter.config.num_drafts, drafter.drafts_per_block] if drafter is not None else []
    block_lengths = sorted({1, 2, 4, 8, *(n + 1 for n in drafts)})
    result.forward_ms = measure_forward_ms(target, prompts[0], block_lengths, drafter)
    by_prompt: list[dict[str, Generation]] = []
    with tqdm(total=len(prompts) * len(methods), desc="bench", unit="gen", disable=not progress) as bar:
        for index, input_ids in enumerate(prompts):
            shift = index % len(methods)
            results = {}
            for method in methods[shift:] + methods[:shift]:
                bar.set_postfix_str(method)
                results[method] = generate(method, input_ids, settings.max_new_tokens, settings.seed + index)
                bar.update()
            by_prompt.append(results)
    for method in methods:
        result.records[method] = [results[method] for results in by_prompt]
    return result


# ------------------------------------------------------------------------------------------------------ summaries
def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_method(result: BenchResult, method: str) -> dict[str, Any]:
    """Aggregates one method's records; speedups and mismatches compare with the `target` records of the same run."""
    records = result.records[method]
    tokens = sum(len(record.new_tokens) for record in records)
    seconds = sum(record.seconds for record in records)
    acceptance = [length for record in records for length in record.acceptance_lengths]
    forwards = sum(len(record.acceptance_lengths) + 1 for record in records)  # + the prefill
    summary: dict[str, Any] = {
        "prompts": len(records),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else None,
        "mean_acceptance_length": _mean(acceptance),
        "acceptance_histogram": {str(k): v for k, v in sorted(Counter(acceptance).items())},
        "ms_per_target_forward": 1000 * seconds / forwards if forwards else None,
    }
    baseline = result.records.get("target")
    greedy = result.settings.temperature == 0
    summary |= _against_baseline(records, baseline, greedy) if baseline else _against_baseline([], [], False)
    summary |= _latency_split(records)
    return summary


def _tokens_per_second(records: Sequence[Generation]) -> float | None:
    seconds = sum(record.seconds for record in records)
    return sum(len(record.new_tokens) for record in records) / seconds if seconds else None


def _against_baseline(records: Sequence[Generation], baseline: Sequence[Generation], greedy: bool) -> dict[str, Any]:
    method_tps, base_tps = _tokens_per_second(records), _tokens_per_second(baseline)
    # Per prompt in tokens/s, not seconds: with sampling, or past a mismatch, the lengths can differ.
    ratios = [
        (len(record.new_tokens) / record.seconds) / (len(base.new_tokens) / base.seconds)
        for record, base in zip(records, baseline)
        if record.seconds and base.seconds and base.new_tokens
    ]
    return {
        "speedup_total": method_tps / base_tps if method_tps and base_tps else None,
        "speedup_median": statistics.median(ratios) if ratios else None,
        "greedy_mismatches": sum(r.new_tokens != b.new_tokens for r, b in zip(records, baseline)) if greedy else None,
    }


def _latency_split(records: Sequence[Generation]) -> dict[str, Any]:
    """Mean ms of each cycle piece over all cycles of all prompts, the cycle total and the head's share of it."""
    if not any(record.timings for record in records):
        return {"latency_ms": None, "head_share_of_cycle": None}
    latency = {}
    for key in TIMING_KEYS:
        mean = _mean([value for record in records for value in (record.timings or {}).get(key, [])])
        if mean is not None:
            latency[key] = 1000 * mean
    latency["cycle"] = sum(latency.values())
    head_share = latency.get("head", 0.0) / latency["cycle"] if latency["cycle"] else None
    return {"latency_ms": latency, "head_share_of_cycle": head_share}


def summarize(result: BenchResult) -> dict[str, dict[str, Any]]:
    """`summarize_method` for every method, plus the transformers-loop overhead of `domino` over `manual`."""
    summaries = {method: summarize_method(result, method) for method in result.methods}
    manual, domino = summaries.get("manual"), summaries.get("domino")
    if manual and domino and manual["new_tokens"] and domino["new_tokens"]:
        # Same drafter and greedy tokens, hence the same acceptance: the per-token time difference is the loop's cost.
        per_token = [s["seconds"] / s["new_tokens"] for s in (domino, manual)]
        domino["loop_overhead_vs_manual"] = per_token[0] / per_token[1] - 1
    return summaries


def result_to_json(result: BenchResult) -> dict[str, Any]:
    return {
        "metadata": result.metadata,
        "settings": asdict(result.settings),
        "methods": result.methods,
        "summary": summarize(result),
        "target_forward_ms_by_tokens": result.forward_ms,
        "records": {method: [asdict(record) for record in records] for method, records in result.records.items()},
    }


# ------------------------------------------------------------------------------------------------------- reports
def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def markdown_report(result: BenchResult) -> str:
    """Markdown tables: throughput and acceptance per method, then the per-cycle latency split."""
    summaries = summarize(result)
    meta = result.metadata
    lines = []
    if meta:
        lines += [f"- {key}: `{value}`" for key, value in meta.items()]
        lines.append("")
    lines += [
        "| method | acceptance length | tokens/s | speedup (totals) | speedup (median/prompt) "
        "| ms / target forward | greedy mismatches |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, s in summaries.items():
        mismatches = "-" if s["greedy_mismatches"] is None else f"{s['greedy_mismatches']}/{s['prompts']}"
        lines.append(
            f"| {method} | {_fmt(s['mean_acceptance_length'])} | {_fmt(s['tokens_per_second'])} "
            f"| {_fmt(s['speedup_total'], '{:.2f}x')} | {_fmt(s['speedup_median'], '{:.2f}x')} "
            f"| {_fmt(s['ms_per_target_forward'], '{:.1f}')} | {mismatches} |"
        )
    timed = {method: s for method, s in summaries.items() if s["latency_ms"]}
    if timed:
        lines += [
            "",
            "Mean per drafting cycle, ms (verify = target forward and the loop's acceptance work):",
            "",
            "| method | draft backbone | LM head (draft block) | Domino head / pick | target verify | cycle "
            "| head share |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for method, s in timed.items():
            latency = s["latency_ms"]
            cells = " | ".join(_fmt(latency.get(key), "{:.1f}") for key in TIMING_KEYS)
            lines.append(
                f"| {method} | {cells} | {_fmt(latency['cycle'], '{:.1f}')} "
                f"| {_fmt(s['head_share_of_cycle'], '{:.1%}')} |"
            )
    if result.forward_ms:
        one = result.forward_ms.get(1)
        lines += [
            "",
            "Target forward cost by tokens per forward (prompt 0 cached; verify of k drafts = k + 1 tokens):",
            "",
            "| tokens | " + " | ".join(str(n) for n in result.forward_ms) + " |",
            "|---|" + "---:|" * len(result.forward_ms),
            "| ms | " + " | ".join(f"{ms:.1f}" for ms in result.forward_ms.values()) + " |",
        ]
        if one:
            lines.append(
                "| x one token | " + " | ".join(f"{ms / one:.2f}" for ms in result.forward_ms.values()) + " |"
            )
    overhead = summaries.get("domino", {}).get("loop_overhead_vs_manual")
    if overhead is not None:
        lines += ["", f"transformers loop vs manual loop, time per token: {overhead:+.1%}"]
    return "\n".join(lines) + "\n"


def write_plots(result: BenchResult, output_dir: Path) -> dict[str, Path]:
    """Acceptance histogram, speedup per method and per-cycle latency split, as PNGs (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = summarize(result)
    plots = {"acceptance": _plot_acceptance, "speedup": _plot_speedup, "latency": _plot_latency}
    paths = {}
    for name, plot in plots.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        plot(ax, summaries, result.title)
        fig.tight_layout()
        paths[name] = output_dir / PLOT_FILES[name]
        fig.savefig(paths[name], dpi=120)
        plt.close(fig)
    return paths


def _plot_acceptance(ax, summaries: dict[str, dict[str, Any]], title: str) -> None:
    methods = [m for m, s in summaries.items() if m != "target" and s["acceptance_histogram"]]
    longest = max((int(k) for m in methods for k in summaries[m]["acceptance_histogram"]), default=1)
    lengths = list(range(1, longest + 1))
    width = 0.8 / max(len(methods), 1)
    for offset, method in enumerate(methods):
        histogram = summaries[method]["acceptance_histogram"]
        total = sum(histogram.values())
        shares = [histogram.get(str(length), 0) / total for length in lengths]
        positions = [length + (offset - (len(methods) - 1) / 2) * width for length in lengths]
        ax.bar(positions, shares, width, label=f"{method} (mean {summaries[method]['mean_acceptance_length']:.2f})")
    ax.set(xlabel="tokens per target forward", ylabel="share of target forwards", title=f"Acceptance length {title}")
    ax.set_xticks(lengths)
    if methods:
        ax.legend()


def _plot_speedup(ax, summaries: dict[str, dict[str, Any]], title: str) -> None:
    methods = [m for m, s in summaries.items() if s["speedup_total"] is not None]
    values = [summaries[m]["speedup_total"] for m in methods]
    bars = ax.bar(methods, values, color="tab:blue")
    ax.bar_label(bars, labels=[f"{value:.2f}x" for value in values])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(ylabel="speedup over target alone (tokens/s, totals)", title=f"Speedup {title}")


def _plot_latency(ax, summaries: dict[str, dict[str, Any]], title: str) -> None:
    methods = [m for m, s in summaries.items() if s["latency_ms"]]
    bottoms = [0.0] * len(methods)
    for key in TIMING_KEYS:
        heights = [summaries[m]["latency_ms"].get(key, 0.0) for m in methods]
        ax.bar(methods, heights, bottom=bottoms, label=key)
        bottoms = [bottom + height for bottom, height in zip(bottoms, heights)]
    ax.set(ylabel="ms per drafting cycle", title=f"Where a drafting cycle's time goes {title}")
    if methods:
        ax.legend()


def write_report(result: BenchResult, output_dir: str | os.PathLike) -> dict[str, Path]:
    """Writes `bench.json`, `bench.md` and the PNG plots into `output_dir`; returns their paths."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": output_dir / "bench.json", "markdown": output_dir / "bench.md"}
    paths["json"].write_text(json.dumps(result_to_json(result), indent=1) + "\n")
    paths["markdown"].write_text(markdown_report(result))
    return paths | write_plots(result, output_dir)


def machine_metadata(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "machine": f"{cpu}, {os.cpu_count()} cores",
        # Other processes on the cores wreck multi-threaded CPU timings (thread barriers stall): keep the evidence.
        "load_average_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "device": "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------------------------------------------------ CLI
def _methods(value: str) -> list[str]:
    methods = [m.strip() for m in value.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose among {', '.join(METHODS)}")
    return methods


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2", help="'smollm2' (offline SmolLM2-135M-Instruct) or a path")
    parser.add_argument("--drafter", default=None, help=f"drafter folder (default: {SHIPPED_DRAFTER})")
    parser.add_argument("--prompts", default="mtbench", help="mtbench, humaneval, sharegpt, or a jsonl file")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    parser.add_argument(
        "--methods", type=_methods, default=list(METHODS), help=f"comma-separated among {','.join(METHODS)}"
    )
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="drafts verified per target forward (drafter.num_speculative_tokens; default: the whole block)",
    )
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--output-dir", default=None, help="default: runs/bench/<prompts>-T<temperature>")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def command_line(args: argparse.Namespace) -> str:
    """The `hf-domino bench` command that reproduces `args`, for the report."""
    parts = ["hf-domino bench"]
    for key, value in vars(args).items():
        if key in ("module_name", "command", "progress") or value is None:
            continue
        value = ",".join(value) if isinstance(value, list) else value
        parts.append(f"--{key.replace('_', '-')} {value}")
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    from .data import load_target

    torch.set_num_threads(args.threads)
    metadata = machine_metadata(args.threads)
    if (metadata["load_average_1min_at_start"] or 0) > 0.5:
        print(f"Warning: load average {metadata['load_average_1min_at_start']:.1f}: timings will not be reliable.")
    dtype = getattr(torch, args.dtype)
    methods = list(args.methods)
    if args.temperature > 0 and any(m in GREEDY_ONLY_METHODS for m in methods):
        print(f"Skipping {', '.join(GREEDY_ONLY_METHODS)} at temperature {args.temperature}: greedy only.")
        methods = [m for m in methods if m not in GREEDY_ONLY_METHODS]
    needs_drafter = any(m in DRAFTER_METHODS for m in methods)
    try:
        drafter = load_drafter(args.drafter, dtype=dtype) if needs_drafter else None
    except FileNotFoundError as error:
        raise SystemExit(f"hf-domino bench: {error}") from None
    target, tokenizer = load_target(args.target, dtype=dtype)
    if drafter is not None:
        drafter.to(target.device)
        drafter.num_speculative_tokens = args.num_speculative_tokens
    prompts = [encode_chat(tokenizer, messages) for messages in assets.load_prompts(args.prompts, args.num_prompts)]
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        warmup_tokens=args.warmup_tokens,
    )
    result = run_benchmark(target, drafter, prompts, methods, settings, progress=args.progress)
    prompt_set = Path(args.prompts).stem if Path(args.prompts).suffix else args.prompts
    result.metadata = {
        "command": command_line(args),
        **metadata,
        "target": args.target,
        "drafter": str(args.drafter or SHIPPED_DRAFTER),
        "dtype": args.dtype,
        "prompts": f"{prompt_set} ({len(prompts)} prompts, mean {_mean([p.shape[1] for p in prompts]) or 0:.0f} "
        "prompt tokens, chat template)",
        "speedup": "tokens/s of the method over tokens/s of the target alone, totals over all prompts, same run",
    }
    result.title = f"({prompt_set}, T={args.temperature:g})"
    output_dir = args.output_dir or f"runs/bench/{prompt_set}-T{args.temperature:g}"
    paths = write_report(result, output_dir)
    print(markdown_report(result))
    print("Wrote " + ", ".join(str(path) for path in paths.values()))
    return 0
