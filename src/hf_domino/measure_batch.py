"""Benchmark runs of batched generation: a drafter serving B prompts at once against the batched target alone.

`hf-domino bench --batch-size 1,2,4,8` calls `run_batch_benchmark`: the same prompts, split into consecutive groups of
B and left-padded, go through `target.generate(**batch)` alone and with the drafter, interleaved group by group in one
process. Throughput is the tokens every row generated (up to its EOS) over the wall time of all groups; tau is tokens
per target forward per row. Every group's outputs are compared with the target alone's. With `--repeats N` each
group runs N times, methods interleaved, and its median time counts.
"""

from __future__ import annotations

import contextlib
import copy
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import ContinuousBatchingConfig, PreTrainedModel, PreTrainedTokenizerBase

from . import batching_domino
from .assets import chat_token_ids, eos_token_ids, load_drafter, load_target, pad_token_id
from .cost_model_domino import synchronize
from .cpu_fast_path import prepare_for_cpu_decoding
from .measure import TIMING_KEYS, method_context, own_verify_cost
from .modeling_domino import DominoForSpeculation
from .prompt_sets import load_prompts

BATCH_METHODS = ("target", "domino", "domino_lookup")
# The batched target alone: as it runs by default, and with a drafting call's attention kernels (no cuDNN on CUDA in
# half precision: `attention_kernels_domino.drafting_attention_kernels`).
TARGET_METHODS = ("target", "target_no_cudnn")
_BATCH_METHOD = re.compile(
    r"domino(?:(_rowk)|_k(\d+))?(_lookup2|_lookup|_copies)?(_makespan)?(?:_tree(\d+))?(?:@(eager|triton|triton\+graph))?"
)


def parse_batch_method(method: str) -> dict:
    """`target`, `target_no_cudnn` (see `TARGET_METHODS`), `domino` (the drafter alone, adaptive, one k per
    batch), `domino_rowk` (k per row), `domino_k<N>` (fixed k), each optionally with `_lookup` (copied and
    retrieved drafts beside the drafter, what `generate()` does by default), `_lookup2` (the same, retrieving only
    while at most 2 rows are active: `RETRIEVAL_MAX_ROWS = 2`) or `_copies` (copies from the text only), then
    optionally `_makespan` (cycles priced by when the batch's last row finishes, not by the rows' mean tokens:
    `PRICE_BY_MAKESPAN = True`), `_tree<N>` (N first-token branches per row, `domino_branches`), and `@eager`,
    `@triton` or `@triton+graph` to force the Domino head's rollout (`domino_rollout`; by default the head is fused on
    CUDA). Settings of the batch loop itself come back under
    `loop`."""
    if method in TARGET_METHODS:
        return {}
    match = _BATCH_METHOD.fullmatch(method)
    if match is None:
        raise ValueError(
            f"unknown batch method {method!r}: use target, target_no_cudnn, domino, domino_rowk or domino_k<N>, "
            "optionally followed by _lookup, _lookup2 or _copies, then _makespan, then _tree<N>, then @eager, @triton "
            "or @triton+graph (e.g. domino_lookup, domino_lookup_makespan, domino_lookup_tree2, domino_lookup@eager)"
        )
    per_row, fixed, lookup, makespan, branches, rollout = match.groups()
    options: dict = {"domino_lookup": lookup is not None, "domino_datastore": lookup in ("_lookup", "_lookup2")}
    loop = ({"K_PER_ROW": True} if per_row else {}) | ({"RETRIEVAL_MAX_ROWS": 2} if lookup == "_lookup2" else {})
    loop |= {"PRICE_BY_MAKESPAN": True} if makespan else {}
    options |= {"loop": loop} if loop else {}
    options |= {"domino_rollout": rollout} if rollout else {}
    options |= {"domino_branches": int(branches)} if branches else {}
    if fixed is not None:
        return options | {"draft_policy": "fixed", "num_speculative_tokens": int(fixed)}
    return options | {"draft_policy": "adaptive"}


def left_padded_batch(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[list[int]], pad: int
) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids in conversations)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in conversations])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in conversations])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def left_padded_groups(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[list[int]], size: int, pad: int
) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of `size` token-id prompts, each left-padded (`left_padded_batch`); a last incomplete group
    is dropped, so that every group is a batch of `size` rows."""
    return [
        left_padded_batch(tokenizer, conversations[i : i + size], pad)
        for i in range(0, len(conversations) - size + 1, size)
    ]


def paged_cache_for(prompts: Sequence[list[int]], rows: int, max_new_tokens: int) -> ContinuousBatchingConfig:
    """transformers' continuous batching of the target alone, `rows` requests at a time, its paged cache sized for
    these requests (by default it takes a share of the machine's memory)."""
    pages_per_row = (max(map(len, prompts)) + max_new_tokens) // 32 + 2
    return ContinuousBatchingConfig(max_requests_per_batch=rows, page_size=32, num_blocks=rows * pages_per_row)


def smollm2_batches(
    prompt_set: str, num_prompts: int, batch_size: int, threads: int = 2
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, DominoForSpeculation, list[dict[str, torch.Tensor]]]:
    """What the batch examples measure: the SmolLM2 target and the shipped drafter on the CPU fast path (`threads`
    torch threads), and the first `num_prompts` chat prompts of `prompt_set` in left-padded groups of `batch_size`
    rows (`left_padded_groups`)."""
    torch.set_num_threads(threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter(None)
    prepare_for_cpu_decoding(target, drafter, batch_size=batch_size)
    prompts = [chat_token_ids(tokenizer, messages) for messages in load_prompts(prompt_set, num_prompts)]
    return (
        target,
        tokenizer,
        drafter,
        left_padded_groups(tokenizer, prompts, batch_size, pad_token_id(target, tokenizer)),
    )


def row_lengths(output: torch.Tensor, prompt_width: int, eos: Sequence[int]) -> list[int]:
    """Tokens each row generated, up to and including its EOS (the padding after it is not work)."""
    lengths = []
    for row in output[:, prompt_width:]:
        hits = torch.isin(row, torch.tensor(list(eos), dtype=row.dtype, device=row.device)).nonzero()
        lengths.append(int(hits[0]) + 1 if hits.numel() else row.numel())
    return lengths


def generated_tokens(output: torch.Tensor, prompt_width: int, eos: Sequence[int]) -> int:
    """Tokens the rows generated in all (see `row_lengths`)."""
    return sum(row_lengths(output, prompt_width, eos))


@contextlib.contextmanager
def counting_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts `model`'s forward calls inside the block (`count[0]`)."""
    count = [0]
    handle = model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        handle.remove()


def differing_rows(reference: torch.Tensor, output: torch.Tensor) -> int:
    if reference.shape != output.shape:
        return reference.shape[0]
    return int((reference != output).any(dim=-1).sum())


@dataclass
class BatchRow:
    batch_size: int
    method: str
    tokens: int = 0
    prompts_given: int = 0  # a last group smaller than the batch is left out (`prompts_measured`)
    seconds: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)  # per group: its rows' tokens per target forward
    accepted_tokens: int = 0  # over all groups, rows and forwards after the prefill: the tokens each forward added
    accepting_forwards: int = 0  # ... and how many (row, forward) pairs added them
    mismatched_rows: int | None = None  # None: not compared (sampling, or no `target` method to compare with)
    longest_rows: list[int] = field(default_factory=list)  # per group: the longest row's generated tokens
    forwards: list[int] = field(default_factory=list)  # per group: target forwards after the prefill
    timings: dict[str, list[float]] = field(default_factory=dict)  # seconds per drafting cycle, by piece

    @property
    def throughput(self) -> float:
        return self.tokens / max(sum(self.seconds), 1e-9)

    @property
    def prompts_measured(self) -> int:
        return self.batch_size * len(self.forwards)

    @property
    def tau(self) -> float | None:
        """Tokens per target forward per row, pooled over every row and forward of every group."""
        return self.accepted_tokens / self.accepting_forwards if self.accepting_forwards else None

    @property
    def batch_tau(self) -> float | None:
        """How fast the batch as a whole advanced: its longest row's tokens per target forward after the prefill.

        The batch is done when its last row is, and a step costs about as much at 2-4 rows as at one on a CPU, so
        this, not the rows' mean `tau`, is what drafting must raise: rows that accept more and finish first save little.
        """
        # The prefill's forward also gives each row its first token.
        return (sum(self.longest_rows) - len(self.forwards)) / sum(self.forwards) if sum(self.forwards) else None


def _generate(target, drafter, batch, method: str, max_new_tokens: int, temperature: float, tables: dict):
    options = parse_batch_method(method)
    loop = options.pop("loop", {})  # module settings of the batch loop, for this call only
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    if options:  # a drafting method: its drafting cycles timed piece by piece (as its adaptive policy times them)
        options |= {"assistant_model": drafter, "domino_timings": True}
    previous = {name: getattr(batching_domino, name) for name in loop}
    for name, value in loop.items():
        setattr(batching_domino, name, value)
    try:
        with method_context(method, target), own_verify_cost(target, tables, method):
            return target.generate(**batch, max_new_tokens=max_new_tokens, **sampling, **options)
    finally:
        for name, value in previous.items():
            setattr(batching_domino, name, value)


@torch.no_grad()
def run_batch_benchmark(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: DominoForSpeculation,
    conversations: Sequence,
    batch_sizes: Sequence[int],
    methods: Sequence[str] = BATCH_METHODS,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    warmup_tokens: int = 16,
    seed: int = 0,
    repeats: int = 1,
) -> list[BatchRow]:
    """One `BatchRow` per (batch size, method); "target" is the baseline of each batch size.

    Each group runs `repeats` times, the methods interleaved within every repeat, and counts with its median time:
    on a shared CPU one call can vary by 15-20% (a batch of 8 prompts alone: 10.2 s, then 12.1 s).
    """
    pad, eos = pad_token_id(target, tokenizer), eos_token_ids(target, tokenizer)
    prompts = [chat_token_ids(tokenizer, messages) for messages in conversations]
    rows: list[BatchRow] = []
    if drafter.datastore is not None:
        drafter.datastore.build_index()  # else whichever generation retrieves first pays for it
    # What the adaptive policy learns (acceptance, rates, pauses) is kept per drafter object: a copy per method, so
    # that one method's decisions never start from another's (e.g. `_makespan` from the mean's discounted rates).
    drafters = {method: copy.deepcopy(drafter) for method in methods if method not in TARGET_METHODS}
    tables: dict = {}  # and the target's verify-cost table (`own_verify_cost`)
    for batch_size in batch_sizes:
        batches = [
            {name: tensor.to(target.device) for name, tensor in batch.items()}
            for batch in left_padded_groups(tokenizer, prompts, batch_size, pad)
        ]
        results = {method: BatchRow(batch_size, method, prompts_given=len(prompts)) for method in methods}
        for method in methods:  # warm-up: kernels, and the adaptive policy's cost table for this batch shape
            _generate(target, drafters.get(method), batches[0], method, warmup_tokens, temperature, tables)
        for batch in batches:
            seconds: dict[str, list[float]] = {method: [] for method in methods}
            for repeat in range(repeats):
                outputs = {}
                for method in methods:
                    torch.manual_seed(seed)
                    with counting_forwards(target) as forwards:
                        start = time.perf_counter()
                        outputs[method] = _generate(
                            target, drafters.get(method), batch, method, max_new_tokens, temperature, tables
                        )
                        synchronize(target.device)
                        seconds[method].append(time.perf_counter() - start)
                    if repeat == 0:
                        results[method].forwards.append(forwards[0] - 1)
                        if method not in TARGET_METHODS:
                            stats = drafters[method].last_generation_stats
                            results[method].acceptance.append(stats.mean_acceptance_length)
                            results[method].accepted_tokens += sum(stats.acceptance_lengths)
                            results[method].accepting_forwards += len(stats.acceptance_lengths)
                            for piece, values in (stats.timings or {}).items():
                                results[method].timings.setdefault(piece, []).extend(values)
                if repeat == 0:
                    _count_tokens(results, outputs, batch["input_ids"].shape[1], eos, compare=temperature == 0)
            for method in methods:
                results[method].seconds.append(statistics.median(seconds[method]))
        rows.extend(results.values())
    return rows


def _count_tokens(results: dict[str, BatchRow], outputs: dict, prompt_width: int, eos, compare: bool) -> None:
    """Adds one group's generated tokens to each method's row and, greedy, its rows differing from the target's."""
    reference = outputs.get("target")
    for method, output in outputs.items():
        lengths = row_lengths(output, prompt_width, eos)
        results[method].tokens += sum(lengths)
        results[method].longest_rows.append(max(lengths))
        if method != "target" and reference is not None and compare:
            results[method].mismatched_rows = (results[method].mismatched_rows or 0) + differing_rows(
                reference, output
            )


def batch_markdown(rows: Sequence[BatchRow]) -> str:
    """The tables docs/benchmarks.md shows: throughput, speedup over the target alone at the same batch size, the
    rows' mean tau and the batch's own (`BatchRow.batch_tau`); then what a drafting cycle costs, piece by piece."""
    return "\n".join([_speed_markdown(rows), *_cycle_markdown(rows)])


def _cycle_markdown(rows: Sequence[BatchRow]) -> list[str]:
    """Mean ms per drafting cycle (a cycle where the drafter ran) of each piece, and the head's share."""
    timed = [row for row in rows if row.timings.get("verify")]
    if not timed:
        return []
    lines = [
        "",
        "Mean per drafting cycle, ms (cycles where the drafter ran, over all rows; verify = the batch's target forward "
        "and the loop's acceptance work):",
        "",
        "| batch | method | drafting cycles | draft backbone | LM head (draft block) | Domino head / pick "
        "| target verify | cycle | head share |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in timed:
        means = {piece: 1000 * statistics.fmean(row.timings[piece]) for piece in TIMING_KEYS if row.timings.get(piece)}
        cycle = sum(means.values())
        cells = " | ".join(f"{means[piece]:.1f}" if piece in means else "" for piece in TIMING_KEYS)
        lines.append(
            f"| {row.batch_size} | {row.method} | {len(row.timings['verify'])} | {cells} | {cycle:.1f} "
            f"| {means.get('head', 0.0) / cycle:.1%} |"
        )
    return lines


def _speed_markdown(rows: Sequence[BatchRow]) -> str:
    baseline = {row.batch_size: row.throughput for row in rows if row.method == "target"}
    lines = [
        "| batch | method | tokens/s | speedup vs target alone (same batch) | tau (tokens/forward/row) "
        "| batch tau (longest row) | rows differing |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        speedup = f"{row.throughput / baseline[row.batch_size]:.2f}x" if row.batch_size in baseline else "-"
        tau = "" if row.tau is None else f"{row.tau:.2f}"
        batch_tau = "" if row.batch_tau is None else f"{row.batch_tau:.2f}"
        differing = "-" if row.method == "target" or row.mismatched_rows is None else row.mismatched_rows
        lines.append(
            f"| {row.batch_size} | {row.method} | {row.throughput:.1f} | {speedup} | {tau} | {batch_tau} "
            f"| {differing} |"
        )
    measured = {row.batch_size: (row.prompts_measured, row.prompts_given) for row in rows}
    if any(used < given for used, given in measured.values()):
        counts = ", ".join(f"{size} rows: {used} of {given}" for size, (used, given) in measured.items())
        lines += ["", f"Prompts measured ({counts}): a last group smaller than the batch is left out."]
    return "\n".join(lines)
