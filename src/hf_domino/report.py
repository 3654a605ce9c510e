"""Reports of a benchmark run: per-method summaries, markdown tables, JSON and PNG plots.

`hf_domino.measure` produces the records (`BenchResult`); everything here only reads them.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .acceptance import mean_acceptance_length
from .measure import TIMING_KEYS, BenchResult, Generation

PLOT_FILES = {"acceptance": "bench_acceptance.png", "speedup": "bench_speedup.png", "latency": "bench_latency.png"}


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
        "mean_acceptance_length": mean_acceptance_length(acceptance) if acceptance else None,
        "acceptance_histogram": {str(k): v for k, v in sorted(Counter(acceptance).items())},
        "ms_per_target_forward": 1000 * seconds / forwards if forwards else None,
    }
    drafted = [k for record in records for k in (record.drafted or [])]
    if drafted:  # how many drafts each target forward verified: the draft policy's choices
        summary["drafts_histogram"] = {str(k): v for k, v in sorted(Counter(drafted).items())}
        summary["mean_drafts"] = sum(drafted) / len(drafted)
    copied = [
        (was_copied, length)
        for record in records
        for was_copied, length in zip(record.copied or [], record.acceptance_lengths)
    ]
    if any(was_copied for was_copied, _ in copied):  # forwards that verified copied or retrieved drafts
        copied_lengths = [length for was_copied, length in copied if was_copied]
        summary["copied_share"] = len(copied_lengths) / len(copied)
        summary["copied_acceptance_length"] = sum(copied_lengths) / len(copied_lengths)
    baseline = result.records.get("target")
    greedy = result.settings.temperature == 0
    summary |= _against_baseline(records, baseline, greedy) if baseline else _against_baseline([], [], False)
    eager = result.records.get("target_eager")
    if eager:  # the CPU fast path's baseline: the target alone with eager linear layers
        against_eager = _against_baseline(records, eager, greedy)
        summary["speedup_vs_eager_target"] = against_eager["speedup_total"]
        summary["greedy_mismatches_vs_eager_target"] = against_eager["greedy_mismatches"]
        summary["greedy_agreement_vs_eager_target"] = against_eager["greedy_agreement"]
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
    agreed = sum(_common_prefix(r.new_tokens, b.new_tokens) for r, b in zip(records, baseline))
    baseline_tokens = sum(len(b.new_tokens) for b in baseline[: len(records)])
    return {
        "speedup_total": method_tps / base_tps if method_tps and base_tps else None,
        "speedup_median": statistics.median(ratios) if ratios else None,
        "greedy_mismatches": sum(r.new_tokens != b.new_tokens for r, b in zip(records, baseline)) if greedy else None,
        # Where outputs may differ by rounding (bf16, another kernel): the share of the baseline's tokens generated
        # before the first difference.
        "greedy_agreement": agreed / baseline_tokens if greedy and baseline_tokens else None,
    }


def _common_prefix(tokens: Sequence[int], other: Sequence[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, other)) if a != b), min(len(tokens), len(other)))


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
    """`summarize_method` for every method, plus the transformers-loop overhead over `manual` of the generate() method
    that drafted as it did (`loop_pair`)."""
    summaries = {method: summarize_method(result, method) for method in result.methods}
    pair = loop_pair(result)
    if pair is not None and summaries["manual"]["new_tokens"] and summaries[pair]["new_tokens"]:
        per_token = [s["seconds"] / s["new_tokens"] for s in (summaries[pair], summaries["manual"])]
        summaries[pair]["loop_overhead_vs_manual"] = per_token[0] / per_token[1] - 1
    return summaries


def loop_pair(result: BenchResult) -> str | None:
    """The generate() method that drafted as `manual` did on every prompt: the drafter's own drafts (no copies), as
    many at every target forward, and as many of them accepted (greedy, the same drafter: a fixed `domino_k<N>` over
    the whole vocabulary, N = manual's block). The same work in another loop, so their time per token differs by the
    loop's cost. None where no method drafted so: an adaptive method drafts other blocks, and its time would mix the
    policy's gain into the loop's cost."""
    if "manual" not in result.records:
        return None

    def work(method: str) -> list[tuple]:
        return [(r.acceptance_lengths, r.drafted, any(r.copied or ())) for r in result.records[method]]

    manual = work("manual")
    return next((method for method in result.methods if method != "manual" and work(method) == manual), None)


def result_to_json(result: BenchResult) -> dict[str, Any]:
    return {
        "metadata": result.metadata,
        "settings": asdict(result.settings),
        "methods": result.methods,
        "summary": summarize(result),
        "target_forward_ms_by_tokens": result.forward_ms,
        "eager_target_forward_ms_by_tokens": result.eager_forward_ms,
        "policy_verify_ms_by_tokens": result.policy_verify_ms,
        "records": {method: [asdict(record) for record in records] for method, records in result.records.items()},
    }


# ------------------------------------------------------------------------------------------------------- reports
def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def _mismatch_cell(mismatches: int | None, agreement: float | None, prompts: int) -> str:
    """`0/10`, or with differences `3/10 (92% agree)`: how much of the baseline's output came before them."""
    if mismatches is None:
        return "-"
    return f"{mismatches}/{prompts}" + (f" ({agreement:.0%} agree)" if mismatches and agreement is not None else "")


def markdown_report(result: BenchResult) -> str:
    """Markdown tables: throughput and acceptance per method, then the per-cycle latency split."""
    summaries = summarize(result)
    meta = result.metadata
    lines = []
    if meta:
        lines += [f"- {key}: `{value}`" for key, value in meta.items()]
        lines.append("")
    with_eager = "target_eager" in result.records and bool(result.records["target_eager"])
    eager_header = " vs eager target | mismatches vs eager |" if with_eager else ""
    lines += [
        "| method | acceptance length | tokens/s | speedup (totals) | speedup (median/prompt) "
        "| ms / target forward | greedy mismatches |" + eager_header,
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if with_eager else ""),
    ]
    for method, s in summaries.items():
        mismatches = _mismatch_cell(s["greedy_mismatches"], s["greedy_agreement"], s["prompts"])
        eager_cells = ""
        if with_eager:
            eager_mismatches = _mismatch_cell(
                s["greedy_mismatches_vs_eager_target"], s["greedy_agreement_vs_eager_target"], s["prompts"]
            )
            eager_cells = f" {_fmt(s['speedup_vs_eager_target'], '{:.2f}x')} | {eager_mismatches} |"
        lines.append(
            f"| {method} | {_fmt(s['mean_acceptance_length'])} | {_fmt(s['tokens_per_second'])} "
            f"| {_fmt(s['speedup_total'], '{:.2f}x')} | {_fmt(s['speedup_median'], '{:.2f}x')} "
            f"| {_fmt(s['ms_per_target_forward'], '{:.1f}')} | {mismatches} |" + eager_cells
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
        compiled = result.metadata.get("target_forward") == "compiled"
        lines += [
            "",
            "Target forward cost by tokens per forward (prompt 0 cached; verify of k drafts = k + 1 tokens"
            + ("; the forward called directly, not generate()'s compiled one" if compiled else "")
            + "):",
            "",
            "| tokens | " + " | ".join(str(n) for n in result.forward_ms) + " |",
            "|---|" + "---:|" * len(result.forward_ms),
            "| ms | " + " | ".join(f"{ms:.1f}" for ms in result.forward_ms.values()) + " |",
        ]
        if one:
            lines.append(
                "| x one token | " + " | ".join(f"{ms / one:.2f}" for ms in result.forward_ms.values()) + " |"
            )
        eager_one = result.eager_forward_ms.get(1)
        if eager_one:
            lines += [
                "| ms, eager linears | " + " | ".join(f"{ms:.1f}" for ms in result.eager_forward_ms.values()) + " |",
                "| x one token, eager | "
                + " | ".join(f"{ms / eager_one:.2f}" for ms in result.eager_forward_ms.values())
                + " |",
            ]
    chosen = {method: s for method, s in summaries.items() if s.get("drafts_histogram")}
    if chosen:
        longest = max(int(k) for s in chosen.values() for k in s["drafts_histogram"])
        lines += [
            "",
            "Drafts verified per target forward (0 = a plain target step), share of forwards; copied: the share of "
            "forwards that verified drafts copied from the text or retrieved from the drafter's datastore (no "
            "drafter ran), and the tokens those added:",
            "",
            "| method | mean | copied | " + " | ".join(str(k) for k in range(longest + 1)) + " |",
            "|---|---:|---:|" + "---:|" * (longest + 1),
        ]
        for method, s in chosen.items():
            total = sum(s["drafts_histogram"].values())
            shares = [s["drafts_histogram"].get(str(k), 0) / total for k in range(longest + 1)]
            cells = " | ".join("" if not share else f"{share:.0%}" for share in shares)
            copied = f"{s['copied_share']:.0%}, {s['copied_acceptance_length']:.2f}" if "copied_share" in s else ""
            lines.append(f"| {method} | {s['mean_drafts']:.2f} | {copied} | {cells} |")
    if result.policy_verify_ms:
        lengths = sorted({n for table in result.policy_verify_ms.values() for n in table})
        lines += [
            "",
            "The draft policies' verify cost model at the end of the run, each method's own (measured when the models were prepared, else at "
            "first use, refined online from that method's cycles; ms per cycle by tokens verified):",
            "",
            "| method | " + " | ".join(str(n) for n in lengths) + " |",
            "|---|" + "---:|" * len(lengths),
        ]
        for method, table in result.policy_verify_ms.items():
            lines.append(
                f"| {method} | " + " | ".join(f"{table[n]:.1f}" if n in table else "" for n in lengths) + " |"
            )
    pair = loop_pair(result)
    if pair is not None and "loop_overhead_vs_manual" in summaries[pair]:
        overhead = summaries[pair]["loop_overhead_vs_manual"]
        lines += ["", f"transformers loop ({pair}) vs manual loop, the same blocks, time per token: {overhead:+.1%}"]
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
