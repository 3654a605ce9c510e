"""The draft policy's cost model: what a drafting cycle costs, and what it is expected to earn.

A cycle verifies `1 + k` tokens in one target forward. `VerifyCost` is its time by the number of tokens, measured with
a few target forwards at first use per (target, device, dtype) (`measure_verify_cost`, `verify_cost_for`) and refined
from the loops' own timings; a batch reads it by all the forward's tokens. `expected_tokens` is what the cycle earns:
`E(k) = 1 + sum_{j <= k} prod_{i <= j} a_i` for acceptance `a_j` per draft position, averaged over a batch's rows
or, for a batch that is done when its last row is, priced by `makespan_tokens`. The policies in `policy_domino` divide
the one by the other.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers.utils import logging

from .cache_domino import cache_argument
from .recurrent_cache_domino import RecurrentRollback, record_past, rolls_back
from .target_modules_domino import dense_weight, offload_hooked, target_execution_device

logger = logging.get_logger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

# The cost table (and the policy's drafting times) move this far towards each new observation.
TIME_RATE = 0.2
# Forward lengths measured at first use; others are interpolated.
CALIBRATION_LENGTHS = (1, 2, 3, 5, 9, 17)
# A table whose times, as the loops observe them, fell below this share of what was measured was measured while
# other work held the machine: the lengths no loop tries again (priced as dearly, verifying drafts looks dear, so
# only plain steps run and only they are observed) would keep their dear prices for good, and the process would never
# draft again. `verify_cost_for` measures such a table again at the next call, at most MAX_REMEASURES times (a
# shape at a time: one sequence's lengths, a batch size's).
BUSY_MEASUREMENT = 0.5
MAX_REMEASURES = 4


# ------------------------------------------------------------------------------------------------------- cost model
class VerifyCost:
    """Seconds of one target forward over n tokens (n = 1 + drafts), interpolated between measured lengths."""

    def __init__(self, seconds_by_length: dict[int, float]):
        # The policies divide by these: a zero (an injected table, a clock that did not move) failed deep in a call.
        if not seconds_by_length or not all(0 < seconds < math.inf for seconds in seconds_by_length.values()):
            raise ValueError(
                f"A verify-cost table maps token counts to the positive seconds of a target forward over them, got "
                f"{seconds_by_length!r}."
            )
        self.seconds = dict(sorted(seconds_by_length.items()))
        self.measured = dict(self.seconds)  # as measured, before any observation
        self.remeasures = 0

    def __call__(self, num_tokens: int) -> float:
        if num_tokens in self.seconds:
            return self.seconds[num_tokens]
        lengths = list(self.seconds)
        below = max((n for n in lengths if n < num_tokens), default=lengths[0])
        above = min((n for n in lengths if n > num_tokens), default=lengths[-1])
        if below == above:
            return self.seconds[below]
        weight = (num_tokens - below) / (above - below)
        return (1 - weight) * self.seconds[below] + weight * self.seconds[above]

    def fixed_share(self, num_tokens: int) -> float:
        """The share of a cycle's cost paid per cycle rather than per row: all of it for one sequence (see
        `batch_policy_domino.BatchVerifyCost.fixed_share`)."""
        return 1.0

    def covers(self, rows: int) -> bool:
        """Whether the table reaches a batch of `rows` verifying whole blocks (`rows x 17` tokens); a table measured
        for smaller batches only would price this one's larger forwards by extrapolation."""
        return rows * CALIBRATION_LENGTHS[-1] <= max(self.seconds)

    def update(self, other: VerifyCost) -> None:
        """Adds the lengths `other` measured (a larger batch's `rows x (1 + k)` shapes) to this table."""
        self.seconds = dict(sorted({**self.seconds, **other.seconds}.items()))
        self.measured.update(other.measured)

    def measured_while_busy(self) -> bool:
        """Whether the loops have since observed some length at under `BUSY_MEASUREMENT` of its measured time."""
        return any(self.seconds[length] < BUSY_MEASUREMENT * seconds for length, seconds in self.measured.items())

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Moves the estimate for `num_tokens` towards a measured cycle (target forward plus the loop's work).

        One cycle counts as at most twice (at least half) the current estimate: a stall of the machine (another
        process, a page fault) must not make a length look dear for good, since a length that looks dear is not
        chosen and so never measured again. A real change still gets through, over a few cycles.
        """
        current = self(num_tokens)
        seconds = min(max(seconds, current / 2), current * 2)
        self.seconds[num_tokens] = current + TIME_RATE * (seconds - current)
        self.seconds = dict(sorted(self.seconds.items()))


# Set while `measure_verify_cost` times forwards: they decode nothing, and whatever counts a call's forwards
# (`acceptance.record_target_forwards`) leaves them out.
MEASURING_COSTS: contextvars.ContextVar[bool] = contextvars.ContextVar("domino_measuring_costs", default=False)

# Per target module (held weakly: a table must not outlive its model, nor pass to a new one at the same address),
# then per device and dtype.
_VERIFY_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def timing_is_free(device: torch.device) -> bool:
    """Whether host timings measure the device's work without a synchronization: everywhere but on CUDA."""
    return device.type != "cuda"


def settle_for_timing(device: torch.device, time_is_used: bool) -> None:
    """Before reading a host clock whose reading is used (timings asked for, a policy learning from them): waits for
    the device where host time is not device time (CUDA). The loops read the clock where they read the device's
    results anyway (after a verification, the drafts' confidence), so the wait costs about nothing there."""
    if time_is_used and not timing_is_free(device):
        synchronize(device)


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA), so that a host clock read next measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_verify_cost(
    target: PreTrainedModel,
    cache: Cache,
    last_token: torch.LongTensor,
    forward_kwargs: dict[str, Any],
    lengths: tuple[int, ...] = CALIBRATION_LENGTHS,
    repeats: int = 2,
    rollback: RecurrentRollback | None = None,
) -> VerifyCost:
    """Times target forwards over 1, 2, 3, 5, ... tokens on top of `cache` (which is left as it was, or, with a
    `rollback` of its recurrent layers, one token longer per forward).

    Token values do not change the cost, so the block repeats `last_token`. With a batch (`last_token` of `[rows, 1]`)
    every row gets the block and the table is keyed by all the forward's tokens, `rows * length`: a batch verifying
    k drafts per row costs about what one sequence verifying `rows * (1 + k)` tokens does, and the loop's own timings
    refine the estimate. One unmeasured warm-up forward first.
    The fastest of `repeats` is kept: other work on the machine only ever adds time, and the loop's own timings
    refine the table afterwards. With `rollback`, each forward runs as a drafting call's verification does (the scan's
    inputs kept, on a CPU one chunk: `RecurrentRollback.feed`) and keeps its first token, as a verification whose
    drafts were all rejected does.
    """
    rows = last_token.shape[0]
    seconds: dict[int, float] = {}
    with _measuring():
        for length in (lengths[0], *lengths):
            seconds[rows * length] = _fastest_forward(
                target, cache, last_token[:, -1:].expand(rows, length), forward_kwargs, repeats, rollback
            )
    return VerifyCost(seconds)


@contextlib.contextmanager
def _measuring() -> Iterator[None]:
    token = MEASURING_COSTS.set(True)
    try:
        yield
    finally:
        MEASURING_COSTS.reset(token)


def _fastest_forward(target, cache, block, forward_kwargs, repeats, rollback) -> float:
    """The fastest of `repeats` timed forwards over `block` on top of `cache`, each given back."""
    device, length = block.device, block.shape[1]
    samples = []
    for _ in range(repeats):
        if rollback is not None:
            rollback.feed(rollback.committed + length)
        synchronize(device)
        start = time.perf_counter()
        target(input_ids=block, use_cache=True, **cache_argument(cache), **forward_kwargs)
        synchronize(device)
        samples.append(time.perf_counter() - start)
        if rollback is None:
            cache.crop(-length)
        else:
            rollback.crop(1 - length)
    return min(samples)


# Tokens of context under a table measured on a scratch cache (ids do not change a cost).
CALIBRATION_CONTEXT = 32


@torch.no_grad()
def measure_verify_cost_on_scratch(
    target: PreTrainedModel, forward_kwargs: dict[str, Any], rows: int = 1
) -> VerifyCost:
    """`measure_verify_cost` on a dynamic cache of its own, `CALIBRATION_CONTEXT` tokens in each of `rows` rows: before
    any call (`prepare_for_cpu_decoding`), or where the call's cache cannot take a 17-token block and give it back (a
    static cache holds the call's `max_length` only)."""
    from transformers import DynamicCache

    context = torch.zeros(rows, CALIBRATION_CONTEXT, dtype=torch.long, device=target_execution_device(target))
    cache = DynamicCache(config=target.config)
    record_past(cache)  # sliding-window layers must give the measured blocks back
    with _measuring():
        target(input_ids=context, use_cache=True, **cache_argument(cache))
    if not rolls_back(cache, target):
        return measure_verify_cost(target, cache, context[:, -1:], forward_kwargs)
    rollback = RecurrentRollback.install(cache, CALIBRATION_CONTEXT, target)
    try:
        return measure_verify_cost(target, cache, context[:, -1:], forward_kwargs, rollback=rollback)
    finally:
        rollback.remove()


def verify_cost_for(target: PreTrainedModel, measure) -> VerifyCost:
    """The process-wide cost table of `target` on its device and dtype, measured with `measure()` on first use, and
    again where the loops found it measured while the machine was busy (`VerifyCost.measured_while_busy`)."""
    costs, key = _VERIFY_COSTS.setdefault(target, {}), (str(target.device), str(target.dtype))
    busy = costs.get(key)
    if busy is not None and busy.remeasures < MAX_REMEASURES and busy.measured_while_busy():
        logger.info("The verify-cost table was measured while the machine was busy: measuring it again.")
        fresh = measure()  # the call's shape (one sequence's lengths, or a batch's rows x lengths)
        # The other shapes keep what they hold, and what they were measured at: where it was busy too, a later call
        # of theirs measures them again.
        fresh.seconds = dict(sorted({**busy.seconds, **fresh.seconds}.items()))
        fresh.measured = {**busy.measured, **fresh.measured}
        fresh.remeasures = busy.remeasures + 1
        costs[key] = fresh
    if key not in costs:
        costs[key] = measure()
        hint = cpu_fast_path_hint(target, costs[key])
        if hint:
            logger.warning_once(hint)
    return costs[key]


# A CPU where a forward over 2 tokens costs this many times one over 1 token packs each weight again for every
# product over more than one row (MKL's sgemm, prepacked_linear.py): there `prepare_for_cpu_decoding`'s packed
# products make short verifications nearly as cheap as one token (docs/benchmarks.md: 1.7x -> 1.1x on a 2-core EPYC,
# drafting 1.1-1.2x -> 1.5x the eager target alone).
SLOW_SHORT_VERIFY = 1.4


def _bf16_packs(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _preparing_would_pack(target: PreTrainedModel) -> bool:
    """Whether `prepare_for_cpu_decoding` would pack some of `target`'s products, by its rules (the same
    `offload_hooked` and `dense_weight`; of the dtypes, float32, and bfloat16 where oneDNN packs it): every parameter
    on the CPU, nothing packed yet, and some `nn.Linear` that is neither offloaded nor quantized."""
    if not torch.backends.mkldnn.is_available() or any(p.device.type != "cpu" for p in target.parameters()):
        return False
    if any(type(module).__name__ == "PrepackedLinear" for module in target.modules()):
        return False
    return any(
        type(module) is torch.nn.Linear
        and not offload_hooked(module)
        and dense_weight(module.weight)
        and (module.weight.dtype == torch.float32 or _bf16_packs(module.weight.dtype))
        for module in target.modules()
    )


def cpu_fast_path_hint(target: PreTrainedModel, table: VerifyCost) -> str | None:
    """What to tell the user of an unprepared CPU target whose short verifications, just measured, cost far more
    than one token; None where they do not, or where preparing would pack nothing (the target elsewhere, offloaded,
    quantized, or prepared already)."""
    one, two = table.seconds.get(1), table.seconds.get(2)
    if not one or not two or two / one < SLOW_SHORT_VERIFY or not _preparing_would_pack(target):
        return None
    return (
        f"Drafting on a CPU: a target forward over 2 tokens costs {two / one:.1f}x one over 1 token here (eager "
        "products over more than one row pack their weights again on many CPUs), so verifying drafts gains little. "
        "`hf_domino.prepare_for_cpu_decoding(target, drafter)` (pip install hf-domino) keeps packed weights "
        "instead: on such CPUs drafting then ran about 1.5x the target alone (docs/benchmarks.md). Its products equal "
        "the eager ones up to rounding."
    )


def swap_verify_cost(target: PreTrainedModel, table: VerifyCost | None) -> VerifyCost | None:
    """Makes `table` `target`'s cost table on its device and dtype (None: none, measured at first use) and returns the
    one it replaces, so that runs compared in one process (the bench's methods) can each keep their own."""
    costs, key = _VERIFY_COSTS.setdefault(target, {}), (str(target.device), str(target.dtype))
    previous = costs.pop(key, None)
    if table is not None:
        costs[key] = table
    return previous


def cached_verify_cost(target: PreTrainedModel) -> VerifyCost | None:
    """The cost table the adaptive policy uses for `target`, if one was measured in this process."""
    return _VERIFY_COSTS.get(target, {}).get((str(target.device), str(target.dtype)))


def expected_tokens(
    acceptance: torch.Tensor,
    rooms: list[int] | None = None,
    paces: list[float] | None = None,
    fixed_share: Callable[[int], float] | None = None,
) -> torch.Tensor:
    """`E(k)` for k = 0..K: one target token plus the drafts accepted in a row.

    `acceptance` is `[K]`, or `[rows, K]` for a batch whose rows all verify k drafts: then the rows' mean or, given
    each row's `rooms` (the tokens it may still generate) and optionally its `paces` (`row_paces`) and the share of a
    cycle's cost that the batch pays until its last row finishes, what the cycle saves (`makespan_tokens`).
    """
    rows = acceptance.double()
    survive = torch.cumprod(rows[None] if rows.dim() == 1 else rows, dim=-1)
    if rooms is not None:
        return makespan_tokens(survive, rooms, paces, fixed_share)
    return 1 + torch.cat([survive.new_zeros(survive.shape[0], 1), torch.cumsum(survive, dim=-1)], dim=-1).mean(dim=0)


def makespan_tokens(
    survive: torch.Tensor,
    rooms: list[int],
    paces: list[float] | None = None,
    fixed_share: Callable[[int], float] | None = None,
    points: int = 33,
) -> torch.Tensor:
    """What a cycle verifying k = 0..K drafts per row saves a batch that is done when its last row is.

    Rows advance by different amounts in each cycle, drift apart, and the batch waits for the one that fell behind.
    Priced by the rows' mean, drafting is overpriced: at 4 rows, 64 tokens and a first draft accepted 45% of the
    time, k = 1 advances the rows by 1.45 tokens per cycle, but the batch finishes as if by 1.37 (the more rows, the
    shorter the generation and the longer the blocks, the wider the gap). Priced by one cycle's advance of the
    shortest row, it is underpriced: level rows then count only the drafts that all of them accept (1.04 there),
    though over the next cycles which row lags changes.

    So: the cycles the batch still needs, before and after this one, and their difference. After this cycle, row r
    has `rooms[r] - X_r` tokens left (X_r: 1 + its accepted drafts, by `survive[r, j]`, its chance of accepting at
    least j + 1). Later cycles verify k drafts too; a row's drafts hold as the rows' pooled ones do, times its pace
    (`paces[r]`, default 1): row r advances by `1 + pace (E[X] - 1)` per cycle, so it needs `left / that` more
    cycles, with the variance of a renewal count. Each row's count is taken as normal, and the expected largest one
    is integrated numerically. Priced as what this cycle saves over what a plain step saves (1 token per row): the
    rows' mean for one row, 1 for a plain step, more for drafts in the row that lags, less for drafts in rows ahead.
    Checked against simulated batches in tests/test_draft_policy.py. Returns `[K + 1]`.

    What it saves is time. A later cycle costs a share (`fixed_share(1 + k)`, default all of it) whatever its rows,
    paid until the last row finishes, and the rest by the rows still generating, each until it finishes: the saving
    weighs the batch's cycles and the rows' cycles so. Where a forward costs the same for 1 row or 8 (a GPU), that is
    the last row's cycles; where it grows with the rows (a CPU), the rows' mean counts for much of it.
    """
    K = survive.shape[1]
    at_least = torch.cat([survive.new_ones(survive.shape[0], 1), survive], dim=-1)  # P(X_r >= 1 + j)
    upto = torch.tril(torch.ones(K + 1, K + 1, dtype=torch.float64)).T  # [j, k]: j <= k
    row_mean = at_least @ upto  # [rows, k]: E[X_r], and below Var[X_r] from E[X^2] = sum_j (2j + 1) P(X >= 1 + j)
    row_variance = ((at_least * (2 * torch.arange(K + 1) + 1)) @ upto - row_mean**2).clamp(min=0)
    mean = row_mean.mean(dim=0)[:, None]  # [k, 1]: the pooled X of later cycles
    later = (row_variance + row_mean**2).mean(dim=0)[:, None] - mean**2
    pace = torch.ones(len(rooms), dtype=torch.float64) if paces is None else torch.tensor(paces, dtype=torch.float64)
    advance = 1 + pace[None] * (mean - 1)  # [k, rows]: a row's tokens per later cycle
    count_variance = pace[None] ** 2 * later / advance**3  # a later cycle's, per token left
    room = torch.tensor(rooms, dtype=torch.float64).clamp(min=1)[None]
    # [now / after this cycle / after a plain step, k, rows]: the cycles each row still needs
    centre = torch.stack([room.expand_as(advance), room - row_mean.T, (room - 1).expand_as(advance)]) / advance
    spread = torch.stack([room * count_variance, room * count_variance + row_variance.T / advance**2])  # [2, k, rows]
    spread = torch.cat([spread, spread[:1]]).sqrt().clamp(min=1e-6)
    low = (centre - 6 * spread).amin(dim=(0, 2), keepdim=True)
    high = (centre + 6 * spread).amax(dim=(0, 2), keepdim=True)
    cycles = low + (high - low) * torch.linspace(0, 1, points, dtype=torch.float64)  # [1, k, points]
    below = torch.special.ndtr((cycles[..., None] - centre[:, :, None]) / spread[:, :, None]).prod(dim=-1)
    longest = low[..., 0] + torch.trapezoid(1 - below, cycles, dim=-1)  # [3, k]: E[max_r cycles_r]
    share = torch.tensor(
        [1.0 if fixed_share is None else fixed_share(1 + k) for k in range(K + 1)], dtype=torch.float64
    )
    cycles_left = share * longest + (1 - share) * centre.mean(
        dim=-1
    )  # [3, k]: what later cycles cost, in batch cycles
    return ((cycles_left[0] - cycles_left[1]) / (cycles_left[0] - cycles_left[2])).clamp(min=1)


def row_paces(accepted: list[int], cycles: list[int], prior_cycles: float = 4.0) -> list[float]:
    """How well each row's drafts hold against all rows': its drafts (and copies) accepted per cycle so far, over
    the rows' pooled rate, pulled towards 1 as if it had started with `prior_cycles` cycles at that rate.

    Where rows keep their character over a call (one answer copies itself, another's drafts rarely hold), the row
    that lags now lags later, and `makespan_tokens` prices its drafts by how long it will take. In real calls on a
    2-core CPU a row's past said less than that (`batching_domino.ROW_PACES`, off).
    """
    pooled = sum(accepted) / max(sum(cycles), 1)
    if pooled <= 0:
        return [1.0] * len(accepted)
    return [(n + prior_cycles * pooled) / ((c + prior_cycles) * pooled) for n, c in zip(accepted, cycles)]


__all__ = [
    "CALIBRATION_LENGTHS",
    "VerifyCost",
    "cached_verify_cost",
    "expected_tokens",
    "makespan_tokens",
    "measure_verify_cost",
    "measure_verify_cost_on_scratch",
    "row_paces",
    "settle_for_timing",
    "swap_verify_cost",
    "synchronize",
    "timing_is_free",
    "verify_cost_for",
]
