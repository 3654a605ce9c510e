"""A batch's draft policy: the adaptive policy priced for `rows x (1 + k)` verifications, and the judge of whole calls.

`batch_policy` builds the policy of one batched call (`batching_domino.BatchedDecoding`): its cost table read by all
the tokens of a forward (`BatchVerifyCost`) and its records kept per batch size. Within a call the policies price
each cycle by its rows' mean tokens; a batch finishes with its last row, so after each call `judge_call` compares
the call with what plain steps would have taken for the same tokens, and `call_speculates` makes a batch size whose
calls lose on average take plain steps only in its next calls (docs/architecture.md, "Across calls");
`stops_speculating` can make the same comparison within a call (off: `CALL_CHECK_CYCLES`). A `CallWindow` holds
the cycles judged: a call's, or a server's window of them.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from .cost_model_domino import (
    CALIBRATION_LENGTHS,
    TIME_RATE,
    VerifyCost,
    measure_verify_cost,
    measure_verify_cost_on_scratch,
    timing_is_free,
    verify_cost_for,
)
from .policy_domino import AdaptivePolicy, FixedPolicy
from .records_domino import DrafterRecord, DraftingMode, drafter_record

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .modeling_domino import DominoForSpeculation
    from .options_domino import DominoOptions
    from .ragged_cache_domino import RaggedCache

# A batch size whose speculating calls take clearly longer than plain steps would have (`judge_call`: plain time over
# the call's time, averaged over calls at CALL_GAIN_RATE, below CALL_GAIN_FLOOR; calls of fewer than CALL_MIN_CYCLES
# cycles are too short to tell) takes plain steps only in its next calls, then speculates again: after 1 call, then
# 2, 4, ... at most MAX_PLAIN_CALLS while speculating keeps losing. None: every call speculates (the per-cycle policy
# alone decides).
MAX_PLAIN_CALLS: int | None = 4
CALL_GAIN_RATE = 0.3
CALL_GAIN_FLOOR = 0.97
CALL_MIN_CYCLES = 16
# Within a call (a batch size's first calls have nothing to go by): every CALL_CHECK_CYCLES cycles a speculating call
# compares its cycles so far with what plain steps would have taken for its rows' tokens so far, and below
# CALL_STOP_GAIN takes plain steps for the rest of the call (`stops_speculating`). None: whole calls only.
CALL_CHECK_CYCLES: int | None = None
CALL_STOP_GAIN = 0.9


class BatchVerifyCost:
    """A target's verify-cost table seen from a batch: `rows` sequences of `n` tokens cost what `rows * n` do."""

    def __init__(self, table, rows: int):
        self.table, self.rows = table, rows

    def __call__(self, num_tokens: int) -> float:
        return self.table(self.rows * num_tokens)

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.table.observe(self.rows * num_tokens, seconds)

    def growth(self, branches: int = 1) -> float:
        """What a forward over every row's whole block (`branches` blocks per row) costs, in multiples of one row's
        forward over one block: the table's own scaling from one row to the batch, at least 1."""
        block = CALIBRATION_LENGTHS[-1]
        return max(self.table(self.rows * branches * block) / self.table(block), 1.0)

    def fixed_share(self, num_tokens: int) -> float:
        """The share of verifying `num_tokens` per row that does not grow with the rows (reading the weights, the
        loop's own work), read from the table as a cost `fixed + rows x per_row`: a batch pays it every cycle until
        its last row finishes, and the rest only for the rows still generating (`cost_model_domino.makespan_tokens`).
        """
        whole, one = self(num_tokens), self.table(num_tokens)
        if self.rows == 1 or whole <= 0:
            return 1.0
        per_row = max(whole - one, 0.0) / (self.rows - 1)
        return min(max(one - per_row, 0.0) / whole, 1.0)


def batch_policy(
    target: PreTrainedModel,
    drafter: DominoForSpeculation,
    options: DominoOptions,
    mode: DraftingMode,
    cache: RaggedCache,
    anchor_ids: torch.LongTensor,
    forward_kwargs: dict[str, Any],
    max_drafts: int,
) -> AdaptivePolicy | FixedPolicy:
    """The call's draft policy; the adaptive one reads a cost table that covers `rows x (1 + k)` token forwards."""
    if options.draft_policy == "fixed":
        return FixedPolicy(max_drafts, options.assistant_confidence_threshold)
    rows = anchor_ids.shape[0]

    def measure() -> VerifyCost:
        if cache.recurrent is not None:  # recurrent states cannot give a measured block back
            return measure_verify_cost_on_scratch(target, forward_kwargs, rows)
        return measure_verify_cost(target, cache.cache, anchor_ids, forward_kwargs)

    # Measured here only where neither an earlier call nor `prepare_for_cpu_decoding(..., batch_size=)` did.
    cost = verify_cost_for(target, measure)
    if not cost.covers(rows):
        cost.update(measure())
    verify_cost = BatchVerifyCost(cost, rows)
    # What pays depends on the batch size (verifying rows x (1 + k) tokens), so rates and back-off are learned per
    # batch size; how far drafts hold on this text is the drafter's, shared with every batch size and with batch 1.
    # A tree's acceptance (along the branch taken) is its own, shared by the batch sizes verifying such trees; how
    # far a draft of a given confidence holds is the drafter's whatever the shape.
    branches, num_drafts = options.domino_branches, drafter.config.num_drafts
    single = drafter_record(drafter, target, mode, num_drafts)
    shared = drafter_record(drafter, target, replace(mode, branches=branches), num_drafts)
    shared.calibration = single.calibration
    record = drafter_record(drafter, target, replace(mode, branches=branches, rows=rows), num_drafts)
    record.position_acceptance, record.calibration = shared.position_acceptance, shared.calibration
    if record.backbone_seconds is None and single.backbone_seconds is not None:
        # Before this batch size drafts at all: the drafter's cost measured at batch 1, grown as the target's forward
        # grows from one row's block to all rows' (a tree's branches each rolled out as a row). A drafter is a smaller
        # transformer on the same device, more of its time fixed per layer, so it grows less: on a 2-core CPU its
        # backbone took 4.0/3.9/4.3/6.6 ms at 1/2/4/8 rows while the target's 17-token forward grew 3.6x to 8 rows;
        # on an H200 5.2/4.6/4.4/7.4 ms, the target's nearly flat. An estimate too high is the costly side (drafting
        # waits and is measured late), so the first measured backbone replaces it (`DrafterRecord.backbone_from_prior`).
        record.backbone_seconds = verify_cost.growth() * single.backbone_seconds
        position = single.position_seconds
        record.position_seconds = None if position is None else verify_cost.growth(branches) * position
        record.backbone_from_prior = True
    return AdaptivePolicy(
        record,
        verify_cost,
        # A tree verifies at most what a whole block does (its cost table's widest forward): k <= K / branches, at
        # least 1 unless the call allows no drafts (num_speculative_tokens=0: plain steps).
        cap=max(1, max_drafts // branches) if max_drafts else 0,
        confidence_threshold=options.assistant_confidence_threshold,
        per_position=timing_is_free(drafter.device),
        branches=branches,
    )


# --------------------------------------------------------------------------------------------- the judge of calls
@dataclass
class CallWindow:
    """The cycles the judge of calls weighs against plain steps: a batched call's, or a manager's window of them.

    Per cycle (`cycles`): its active rows, its time and, for a plain step, what a plain-steps-only call pays for it.
    `tokens` arguments are per row, what its cycles generated since it started (`BatchedDecoding.cycle_tokens`); a
    window counts from those it held at its `start` (`next`). A server's batch also says how many rows it runs at a
    time (`limit`: its rows join in their order as others finish) and, per row, when its request came (`arrivals`,
    seconds after the server's first one: plain steps take no row on before it came). None: all rows start together.
    """

    limit: int | None = None
    arrivals: list[float] | None = None
    cycles: list[tuple[int, float, float | None]] = field(default_factory=list)
    tokens_before: list[int] = field(default_factory=list)
    start: float = 0.0

    def steps(self, tokens: list[int]) -> list[int]:
        """Per row, the tokens its cycles generated in this window."""
        before = self.tokens_before + [0] * (len(tokens) - len(self.tokens_before))
        return [count - earlier for count, earlier in zip(tokens, before)]

    def arrived(self) -> list[float] | None:
        """When each row's request came, in seconds after the window's start (None: every row at its start)."""
        if self.arrivals is None:
            return None
        return [max(0.0, came - self.start) for came in self.arrivals]

    def checks(self) -> bool:
        """Whether the cycles so far are judged now (`checks_call`): every `CALL_CHECK_CYCLES`-th, never when None."""
        return checks_call(len(self.cycles))

    def losing(self, policy: AdaptivePolicy, tokens: list[int]) -> bool:
        """Whether the cycles so far lost to plain steps (`stops_speculating`), asked where `checks` says."""
        return stops_speculating(policy, self.cycles, self.steps(tokens), self.limit, self.arrived())

    def judge(self, policy: AdaptivePolicy, tokens: list[int], speculated: bool) -> None:
        """Whether speculating paid in these cycles, for this batch size's next calls (`judge_call`)."""
        judge_call(policy, self.cycles, self.steps(tokens), speculated, self.limit, self.arrived())

    def next(self, start: float, tokens: list[int]) -> None:
        """The next window starts at `start` (seconds after the server's first request), its rows holding `tokens`."""
        self.cycles.clear()
        self.tokens_before, self.start = list(tokens), start


def judge_call(
    policy: AdaptivePolicy,
    cycle_times: list[tuple[int, float, float | None]],
    steps: list[int],
    speculated: bool,
    limit: int | None = None,
    arrivals: list[float] | None = None,
) -> None:
    """After one batched call: learns its plain cycles' times by active rows (`cycle_times`: per cycle, its rows, its
    time and, for a plain step, what a plain-steps-only call pays for it) and, when the call speculated, whether that
    paid: its cycles against what plain steps would have taken for the tokens `steps[r]` each row generated (so its
    stops too; for a server's call, rows joining `limit` at a time, each no earlier than its request's `arrivals`:
    `plain_steps_seconds`), which `learn_call_gain` averages over calls. Calls shorter than `CALL_MIN_CYCLES` are not
    judged."""
    if not MAX_PLAIN_CALLS:
        return
    record = policy.record
    for rows, _, plain in cycle_times:
        if plain is not None:
            current = record.plain_cycle_seconds.get(rows)
            record.plain_cycle_seconds[rows] = plain if current is None else current + TIME_RATE * (plain - current)
    if not speculated or all(plain is not None for _, _, plain in cycle_times) or len(cycle_times) < CALL_MIN_CYCLES:
        return
    learn_call_gain(record, call_gain(policy, cycle_times, steps, limit, arrivals))


def call_gain(
    policy: AdaptivePolicy,
    cycle_times: list[tuple[int, float, float | None]],
    steps: list[int],
    limit: int | None = None,
    arrivals: list[float] | None = None,
) -> float:
    """How many times as fast as plain steps the cycles `cycle_times` went: plain steps' time for the tokens `steps[r]`
    each row generated in them (rows joining `limit` at a time and no earlier than their `arrivals`, if given), over
    their time."""
    spent = sum(seconds for _, seconds, _ in cycle_times)
    plain = plain_steps_seconds(steps, lambda rows: plain_cycle_estimate(policy, rows), limit, arrivals)
    return plain / max(spent, 1e-9)


def checks_call(cycles: int) -> bool:
    """Whether a speculating call is judged after its `cycles`-th cycle: every `CALL_CHECK_CYCLES`-th (never when
    None), so that other cycles pay nothing for it."""
    return bool(CALL_CHECK_CYCLES) and cycles > 0 and cycles % CALL_CHECK_CYCLES == 0


def stops_speculating(
    policy: AdaptivePolicy,
    cycle_times: list[tuple[int, float, float | None]],
    steps: list[int],
    limit: int | None = None,
    arrivals: list[float] | None = None,
) -> bool:
    """Whether a speculating call judged at this cycle (`checks_call`) takes plain steps from here on: when its
    cycles so far went below `CALL_STOP_GAIN` times as fast as plain steps (`call_gain`)."""
    return call_gain(policy, cycle_times, steps, limit, arrivals) < CALL_STOP_GAIN


def plain_cycle_estimate(policy: AdaptivePolicy, rows: int) -> float:
    """A plain cycle's time with `rows` active rows: as measured, else the verify-cost table's forward scaled as the
    measured cycles compare with it (the loop's own work)."""
    known, table = policy.record.plain_cycle_seconds, policy.verify_cost.table
    if rows in known:
        return known[rows]
    ratios = [seconds / table(n) for n, seconds in known.items()]
    return table(rows) * (statistics.median(ratios) if ratios else 1.0)


def learn_call_gain(record: DrafterRecord, gain: float) -> None:
    """Learns from one speculating call of a batch size that went `gain` times as fast as plain steps would have:
    while its calls' average gain is below `CALL_GAIN_FLOOR`, the next calls take plain steps only, 1, then 2, 4, ...
    at most `MAX_PLAIN_CALLS` of them after each call that lost again.

    Averaged, with a margin, because calls differ (2 chat rows' drafts hold in one call and not in the next, which can
    run 0.8x where the average is 1.1x): one losing call of a batch size where speculating pays must not pause it.
    """
    previous = record.call_gain
    record.call_gain = gain if previous is None else previous + CALL_GAIN_RATE * (gain - previous)
    if record.call_gain >= CALL_GAIN_FLOOR:
        record.plain_calls = record.plain_calls_left = 0
    else:
        record.plain_calls = record.plain_calls_left = max(1, min(2 * record.plain_calls, MAX_PLAIN_CALLS))


def call_speculates(record: DrafterRecord) -> bool:
    """Whether a batched call drafts and copies, or takes plain steps only because this batch size's speculating
    calls have been losing to them (`learn_call_gain`). Always True with `MAX_PLAIN_CALLS = None`."""
    if MAX_PLAIN_CALLS and record.plain_calls_left > 0:
        record.plain_calls_left -= 1
        return False
    return True


def plain_steps_seconds(
    steps: list[int],
    seconds_by_rows: Callable[[int], float],
    limit: int | None = None,
    arrivals: list[float] | None = None,
) -> float:
    """What plain steps take to generate `steps[r]` tokens in row r: one token per row per cycle, rows leaving the
    batch as they finish. With `limit` (a server's rows at a time), rows join in their order as places free up, as
    `generate_batch`'s requests do; without, all start together. With `arrivals` (seconds after the call's start at
    which each row's request came: a manager's requests arrive while it runs), a row joins no earlier than that, and
    the time the batch would have stood idle waiting for one does not count."""
    arrivals = arrivals or [0.0] * len(steps)
    waiting = deque(row for row, count in enumerate(steps) if count > 0)
    running: dict[int, int] = {}  # row -> tokens left
    places, clock, busy = limit or len(steps), 0.0, 0.0
    while waiting or running:
        while waiting and len(running) < places and arrivals[waiting[0]] <= clock:
            row = waiting.popleft()
            running[row] = steps[row]
        if not running:
            clock = arrivals[waiting[0]]  # idle until the next request comes
            continue
        cost = max(seconds_by_rows(len(running)), 1e-12)
        cycles = min(running.values())  # until the next row finishes
        if waiting and len(running) < places:  # or the next request comes and joins
            cycles = max(1, min(cycles, math.ceil((arrivals[waiting[0]] - clock) / cost)))
        clock, busy = clock + cycles * cost, busy + cycles * cost
        running = {row: left - cycles for row, left in running.items() if left > cycles}
    return busy


__all__ = [
    "BatchVerifyCost",
    "CallWindow",
    "batch_policy",
    "call_gain",
    "call_speculates",
    "checks_call",
    "judge_call",
    "learn_call_gain",
    "plain_cycle_estimate",
    "plain_steps_seconds",
    "stops_speculating",
]
