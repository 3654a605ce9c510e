"""How many drafts to verify per target forward: fixed, or chosen per block from a measured cost model.

Speedup = tokens per cycle / cycle time. A cycle drafts k tokens (`T_draft(k)`: the backbone, then the LM head and
the head's rollout for k positions) and verifies them in one target forward over `1 + k` tokens (`T_verify(k)`).
On a GPU `T_verify` is nearly flat in k; on a CPU two tokens already cost ~1.6 single-token steps. With the chance
`a_j` that draft j is accepted once drafts `< j` were, the expected tokens of a cycle are
`E(k) = 1 + sum_{j <= k} prod_{i <= j} a_i`, and `AdaptivePolicy` maximizes `E(k) / (T_draft(k) + T_verify(k))`:

1. before drafting (`budget`): the upper bound of k from the acceptance seen at each draft position so far, and
   whether to draft at all. k = 0 is a plain target step: when drafting cycles have been earning fewer tokens per
   second than plain steps (and the acceptance learned per position agrees), the policy skips drafting and probes
   again after 1, 2, 4, ... skipped steps, at most 4 while the drafter's long-run acceptance says drafting pays (in a
   setting never drafted in, such as a new batch size, the cost model's prediction stands in for those cycles);
2. after drafting (`choose`): k from the drafts' own confidences (the probability of each drafted token), mapped to
   acceptance by a calibration learned from the acceptance actually observed (drafters are over-confident off
   their training distribution).

Drafts copied from the text (prompt lookup) are verified by `LookupPolicy`: the same `E(k) / T_verify(k)`, with
their own acceptance per position and no drafting cost.

A tree of n first-token branches (`domino_branches`) verifies `1 + n k` tokens: `choose_tree` picks k and how many
branches, each earning what its own drafts would (`tree_tokens`; a row's first drafts are different tokens, so at most
one of them is right), and `take_branch` makes the outcome teach the policy along the branch taken.

`T_verify` (`cost_model_domino.VerifyCost`) is measured with a few target forwards at first use per (target,
device, dtype) and refined from the loop's own timings; `T_draft` is learned from the drafting steps' timings. What is
learned is kept for the process, per drafter, target and decoding mode (`records_domino`), so later `generate()` calls
start informed. `E(k)`, and a batch's price of it, are `cost_model_domino.expected_tokens`.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .cost_model_domino import TIME_RATE, VerifyCost, expected_tokens
from .records_domino import DrafterRecord

# Online estimates move this far towards each new observation (times: cost_model_domino.TIME_RATE).
POSITION_RATE = 0.2
# ... and the drafter's acceptance per position when sampling: a drawn draft is accepted with probability
# min(1, p/q), a coin toss each cycle, so one cycle says little about the next. At POSITION_RATE a first-draft
# acceptance near 0.3 swung between 0 and 0.5, and the pauses it set off (up to 128 steps, across calls) cost the
# adaptive policy 7% on a 2-core CPU (docs/benchmarks.md, "The adaptive policy when sampling"). Copies keep
# POSITION_RATE: whether they hold follows whether the text repeats, and that was not measured.
SAMPLED_POSITION_RATE = 0.05
RATE_RATE = 0.5
# Drafting is retried after at most this many plain steps once it stopped paying.
MAX_SKIP_INTERVAL = 128
# ... and after at most this many while the drafter's acceptance learned over many cycles (`steady_acceptance`, moving
# at STEADY_RATE, trusted once it has seen STEADY_CYCLES of them) says that drafting pays: a stretch of text the drafter
# cannot follow then costs a few probes, not a pause of 128 steps that outlasts it (HumanEval on a CPU: 1.00x without
# this cap, where drafting pays 1.2x). Until then the optimistic prior would keep an untrained drafter probing.
STEADY_SKIP_INTERVAL = 4
STEADY_RATE = 0.05
STEADY_CYCLES = 20
# A drafting cycle verified for at least this many rows of a batch is judged by its measured rate alone (see observe):
# whether to pause and for how long. At 4 rows on a CPU the acceptance-based second opinions (the one per position,
# and the long run's cap on pauses) kept a drafter that was at best breaking even drafting and probing (0.94x).
BATCH_EVIDENCE_ROWS = 4
# Plain steps before the first probe where the cost model already says drafting will not pay (e.g. a new batch size
# for a drafter whose acceptance on this text is known).
PRIOR_SKIP_INTERVAL = 8
# Whether the policies refine the verify-cost table and the drafter's times from the loops' timings (on CUDA too, where
# the loops then synchronize at their laps). Tests that need a fixed cost table turn it off.
LEARN_TIMES = True


# -------------------------------------------------------------------------------------------------------- policies
class FixedPolicy:
    """Verify `k` drafts every block (0: never draft), cut at the first draft below `confidence_threshold`."""

    adaptive = False

    def __init__(self, k: int, confidence_threshold: float | None = None):
        self.k, self.confidence_threshold = k, confidence_threshold

    def budget(self, room: int) -> int:
        return min(self.k, room)

    def choose(self, confidence: torch.Tensor, draft_seconds: float, limits: list[int] | None = None) -> int:
        if limits is not None:  # a batch: the loop already cut each row at the threshold
            return max(limits)
        return below_threshold(confidence, self.confidence_threshold)

    def choose_tree(self, confidence: torch.Tensor, draft_seconds: float, limits: torch.LongTensor) -> tuple[int, int]:
        """Every branch, as long as its rows allow (the loop already cut each branch at the threshold)."""
        return int(limits.max()), limits.shape[1]

    def take_branch(self, taken: list[int], offered: torch.LongTensor) -> None:
        pass

    def observe(self, **_: Any) -> None:
        pass


def below_threshold(confidence: torch.Tensor, threshold: float | None) -> int:
    """Drafts up to and with the first one whose confidence is under `threshold` (all of them without a threshold):
    transformers' meaning (its `ConfidenceCriteria` ends drafting after such a draft). Whether a draft is offered then
    depends on the drafts before it only, which keeps a sampled call's law: dropping the low draft itself would favour
    the likelier draws."""
    if threshold is None:
        return confidence.numel()
    low = (confidence < threshold).nonzero()
    return int(low[0, 0]) + 1 if low.numel() else confidence.numel()


class AdaptivePolicy:
    """Chooses k per block to maximize expected tokens per second (see the module docstring)."""

    adaptive = True

    def __init__(
        self,
        record: DrafterRecord,
        verify_cost: VerifyCost,
        cap: int,
        confidence_threshold: float | None = None,
        learn_times: bool | None = None,
        per_position: bool | None = None,
        branches: int = 1,
    ):
        self.record, self.verify_cost, self.cap = record, verify_cost, cap
        # A tree of `branches` first-token branches per block (`domino_branches`): k drafts per branch verify
        # 1 + branches x k tokens, and `record` learns acceptance along the branch taken.
        self.branches = branches
        self.confidence_threshold = confidence_threshold
        # Learn the verify-cost table and the drafter's times from the loop's timings (`LEARN_TIMES` by default; on
        # CUDA the loops synchronize at their laps for it, where the device is idle or about to be waited on anyway).
        self.learn_times = LEARN_TIMES if learn_times is None else learn_times
        # Decide after each drafted position whether to roll on (`keep_rolling`): on a CPU only, where a position
        # costs; on CUDA each decision would stop the host until the device caught up, inside the rollout.
        self.per_position = self.learn_times if per_position is None else per_position
        self.probing = False
        self.confidence: torch.Tensor | None = None
        self.tree_confidence: torch.Tensor | None = None  # a tree's, `[rows, n, k]` (`choose_tree`)
        self.drafted_before = False
        self.block_verify_seconds: list[float] | None = None  # _verify_seconds(k), k = 0..cap, for this block
        # For a batch, set by its loop every cycle: the tokens each row may still generate, and how well its drafts
        # have held against the other rows' (`cost_model_domino.row_paces`; None: as well). Cycles are then priced
        # by the time they save a batch that is done when its last row is (`expected_tokens`), not by the rows' mean.
        self.rooms: list[int] | None = None
        self.paces: list[float] | None = None
        self._priced: tuple[tuple, torch.Tensor] | None = None  # the last shared acceptance priced for `rooms`

    # ---------------------------------------------------------------------------------------------- estimates
    def _tokens(self, acceptance: torch.Tensor) -> torch.Tensor:
        """`expected_tokens` of this block: per row `[rows, K]`, or `[K]` that every row of a batch shares.

        Pricing by `rooms` costs about 0.1 ms on a CPU, and a cycle prices the acceptance learned per position up to
        three times (the copies' rival, the budget, the measured rate): that value is kept until either changes.
        """
        if self.rooms is None or acceptance.dim() == 2:
            return expected_tokens(acceptance, self.rooms, self.paces, self.verify_cost.fixed_share)
        key = (tuple(acceptance.tolist()), tuple(self.rooms), None if self.paces is None else tuple(self.paces))
        if self._priced is None or self._priced[0] != key:
            rows = acceptance.expand(len(self.rooms), -1)
            self._priced = key, expected_tokens(rows, self.rooms, self.paces, self.verify_cost.fixed_share)
        return self._priced[1]

    def _draft_seconds(self, k: int) -> float:
        one = self.verify_cost(1)
        backbone = self.record.backbone_seconds if self.record.backbone_seconds is not None else 0.15 * one
        position = self.record.position_seconds if self.record.position_seconds is not None else 0.02 * one
        return backbone + k * position

    def _verify_seconds(self, k: int) -> float:
        """A forward verifying k drafts per branch (`1 + branches x k` tokens; one branch: a block)."""
        return self.verify_cost(1 + self.branches * k)

    def cycle_seconds(self, positions: int, verified: int, tokens: int | None = None) -> float:
        """What the cost model expects a drafting cycle to take: `positions` drafted, `verified` of them verified (in
        a forward of `tokens`, default `1 + verified`)."""
        return self._draft_seconds(positions) + self.verify_cost(tokens or 1 + verified)

    def _expected_rate(self, acceptance: torch.Tensor) -> float:
        """Tokens per second of the best drafting cycle (k >= 1) that the cost model and `acceptance` predict."""
        tokens = self._tokens(acceptance)
        return max(
            float(tokens[k]) / (self._draft_seconds(k) + self._verify_seconds(k)) for k in range(1, len(tokens))
        )

    def _pays(self, position_acceptance: list[float]) -> bool:
        """Whether drafting with this acceptance per draft position beats plain steps, by the cost model."""
        acceptance = torch.tensor(position_acceptance[: max(self.cap, 1)])
        return self._expected_rate(acceptance) >= 1 / self.verify_cost(1)

    def _best_k(self, acceptance: torch.Tensor, spent: float | None, minimum: int = 0) -> int:
        """argmax over k = minimum..len(acceptance) of E(k) / cost(k).

        `spent`: the drafting already paid for this block; None estimates the drafting cost of each k.
        """
        tokens = self._tokens(acceptance)
        costs = torch.tensor(
            [
                (spent if spent is not None else (self._draft_seconds(k) if k else 0.0)) + self._verify_seconds(k)
                for k in range(len(tokens))
            ],
            dtype=torch.float64,
        )
        minimum = min(minimum, len(tokens) - 1)
        return minimum + int(torch.argmax(tokens[minimum:] / costs[minimum:]))

    # ---------------------------------------------------------------------------------------------- decisions
    def budget(self, room: int) -> int:
        record, limit = self.record, min(self.cap, room)
        self.probing, self.confidence, self.block_verify_seconds = False, None, None
        if limit <= 0:
            return 0
        acceptance = torch.tensor(record.position_acceptance[:limit])
        first = record.drafting_rate is None
        if first:
            # Never drafted in this setting (e.g. a new batch size): start from what the cost model and the acceptance
            # seen so far predict, so that a drafter already known not to pay here waits before its first probe.
            record.drafting_rate = self._expected_rate(acceptance)
            if record.drafting_rate < 1 / self.verify_cost(1):
                record.skip_interval = record.skip_left = PRIOR_SKIP_INTERVAL
        # Never drafted yet, or drafting has not been paying: draft anyway now and then (a probe), or nothing will
        # ever be learned about how well the drafter does on this text.
        if first or record.drafting_rate < 1 / self.verify_cost(1):
            if record.skip_left > 0:
                record.skip_left -= 1
                return 0
            self.probing = True
        # Drafting pays, or this is a probe: draft at least one position whatever the cost model's k, so that the
        # drafter's cost keeps being measured (a stale estimate that ruled drafting out would never be corrected);
        # `choose` still verifies nothing when the drafts look poor.
        return self._best_k(acceptance, spent=None, minimum=1)

    def choose(self, confidence: torch.Tensor, draft_seconds: float, limits: list[int] | None = None) -> int:
        """k for this block from the drafts' confidences `[k]`, or `[rows, k]` for a batch with per-row `limits`.

        A batch verifies one rectangle of `rows x (1 + k)` tokens, so one k serves every row: a row never offers
        drafts past its limit (room, threshold, stop strings), which count as certain rejections here.
        """
        self.confidence = confidence.detach().float().cpu()
        if self.record.sampled:  # drawn drafts: whether one is verified must not read it (`_drawn_k`)
            rows = self.confidence if limits is not None else self.confidence[None]
            limits = limits if limits is not None else [below_threshold(self.confidence, self.confidence_threshold)]
            acceptance = self.record.calibration(rows.flatten()).view(rows.shape)
            return self._drawn_k(lambda priced: self._best_k(priced, spent=draft_seconds), acceptance, limits)
        if limits is not None:
            acceptance = self.record.calibration(self.confidence.flatten()).view(self.confidence.shape).clone()
            for row, limit in enumerate(limits):
                acceptance[row, limit:] = 0
            return min(self._best_k(acceptance, spent=draft_seconds), max(limits))
        limit = below_threshold(self.confidence, self.confidence_threshold)
        # A probe's drafts are verified only when their calibrated confidence says so, like any block's: the
        # calibration trusts a confident drafter until the target says otherwise, and an unsure one costs only its
        # drafting.
        return self._best_k(self.record.calibration(self.confidence[:limit]), spent=draft_seconds)

    def _drawn_k(
        self, decide: Callable[[torch.Tensor], int], acceptance: torch.Tensor, limits: Any, chosen: int = 0
    ) -> int:
        """k for drawn drafts (a sampled call's), from `decide(acceptance) -> k` and the calibrated confidence of
        each draft (`acceptance` `[rows, K]`, or `[rows, n, K]` for a tree), each row (branch) offering at most its
        `limits`.

        Speculative sampling keeps the target's law only where whether draft i is verified depends on the drafts
        before it, not on draft i (nor on what follows it, which the head drafts from it). A drawn draft's confidence
        is the probability of the token drawn, so a k read off all of them verifies likelier draws more often (and
        skews what the target outputs towards the drafter's law). So draft i is verified only where `decide`, shown
        the drafts before i at their confidence and the rest at the acceptance learned per position
        (`_pricing`), verifies at least i. Drafts `< chosen` are chosen, not drawn (a tree's first), and priced
        at their confidence throughout. Each row's limit is a rule of the same kind (`below_threshold`,
        `stop_free_length`), so a row whose limit fell before i offers nothing past it.
        """
        priced_before = self._pricing(acceptance, limits, chosen)
        k = 0
        for i in range(1, min(acceptance.shape[-1], int(torch.as_tensor(limits).max())) + 1):
            if decide(priced_before(i)) < i:
                break
            k = i
        return k

    def _pricing(self, acceptance: torch.Tensor, limits: Any, chosen: int = 0) -> Callable[[int], torch.Tensor]:
        """`priced_before(i)`: `acceptance` as `_drawn_k` prices draft i, the drafts before it (and the first
        `chosen`) at their own, the others at the acceptance learned per position, nothing past the limit of a row
        whose limit is below i. What does not depend on i is built once per block."""
        K = acceptance.shape[-1]
        learned = self.record.position_acceptance[:K]
        prior = torch.tensor(learned + [0.0] * (K - len(learned)), dtype=acceptance.dtype)
        position = torch.arange(K)
        limit = torch.as_tensor(limits).cpu()[..., None]

        def priced_before(i: int) -> torch.Tensor:
            priced = torch.where(position < max(i - 1, chosen), acceptance, prior)
            return priced.masked_fill((limit < i) & (position >= limit), 0.0)

        return priced_before

    def choose_tree(self, confidence: torch.Tensor, draft_seconds: float, limits: torch.LongTensor) -> tuple[int, int]:
        """k and how many branches to verify, for a tree: `confidence` `[rows, n, k]` of each row's n branches (the
        first: its likeliest first draft), `limits` `[rows, n]` the drafts each may offer. Every branch costs k
        columns of the forward; it earns when its first draft is the target's next token. (k, 1) is a block, k = 0
        a plain step."""
        self.tree_confidence = confidence.detach().float().cpu()
        self.confidence = self.tree_confidence[:, 0]  # what `observe` learns from, unless a branch is taken
        rows, n, K = self.tree_confidence.shape
        acceptance = self.record.calibration(self.tree_confidence.flatten()).view(rows, n, K)
        costs = torch.tensor(
            [[draft_seconds + self.verify_cost(1 + used * k) for k in range(K + 1)] for used in range(1, n + 1)],
            dtype=torch.float64,
        )

        def best(priced: torch.Tensor) -> tuple[int, int]:  # (branches used, k)
            used, k = divmod(int(torch.argmax(tree_tokens(priced, self._tokens) / costs)), K + 1)
            return used + 1, k

        if self.record.sampled:
            # A tree's first drafts are chosen (each row's likeliest tokens), not drawn: their confidences may decide
            # how many branches, once; the drafts drawn after them are verified as `_drawn_k` says.
            used = best(self._pricing(acceptance, limits, chosen=1)(1))[0]
            k = self._drawn_k(
                lambda priced: int(torch.argmax(tree_tokens(priced, self._tokens)[used - 1] / costs[used - 1])),
                acceptance, limits, chosen=1,
            )  # fmt: skip
            return k, used if k else 1
        acceptance = acceptance.masked_fill(torch.arange(K)[None, None] >= limits[..., None].cpu(), 0.0)
        used, k = best(acceptance)
        return min(k, int(limits.max())), used if k else 1

    def take_branch(self, taken: list[int], offered: torch.LongTensor) -> None:
        """After a tree's verification: what `observe` learns next is along each row's branch `taken[row]`, and the
        first drafts of the other branches a row offered (`offered` `[rows, n]`) were rejected (a row's branches
        start with different tokens, and the target's next token is at most one of them)."""
        confidence = self.tree_confidence[:, : offered.shape[1]]
        others = offered.cpu() > 0
        others[torch.arange(len(taken)), taken] = False
        self.record.calibration.observe(confidence[:, :, 0][others], torch.zeros(int(others.sum()), dtype=torch.bool))
        self.confidence = confidence[torch.arange(len(taken)), taken]

    def rate_without_copies(self) -> float:
        """Tokens per second expected of this block without copied drafts: a drafting cycle's by the acceptance
        learned per position, or a plain step's, whichever is higher (what copies must beat)."""
        acceptance = torch.tensor(self.record.position_acceptance[: max(self.cap, 1)])
        return max(self._expected_rate(acceptance), 1 / self.verify_cost(1))

    def keep_rolling(self, confidence: torch.Tensor) -> bool:
        """Whether rolling the head out past the `j` drafts so far (`confidence` `[j]`, or `[rows, j]`) can still pay.

        The rollout is sequential, so on a CPU every position costs (about a tenth of a cycle for eight of them) and
        `budget` is an upper bound that `choose` usually cuts. Here each later draft is assumed certain to be accepted
        (calibrated acceptance is never above 1), so the rollout never stops before a draft that `choose` would still
        have verified. A batch's blocks are priced here by the rows' mean, which favours long blocks more than
        pricing by `rooms` does. Always True without `per_position` (on CUDA, where a decision per position would
        synchronize with the device).
        """
        if not self.per_position:
            return True
        drafted = confidence.shape[-1]
        if drafted >= self.cap:
            return False
        if self.block_verify_seconds is None:  # asked once per position: read the table once per block
            self.block_verify_seconds = [self._verify_seconds(k) for k in range(self.cap + 1)]
        verify = self.block_verify_seconds
        confidence = confidence.detach().float().cpu()
        acceptance = self.record.calibration(confidence.flatten()).view(confidence.shape)
        if self.branches > 1:  # a tree's rows: each row's branches, one after the other
            tokens = tree_tokens(acceptance.view(-1, self.branches, drafted), expected_tokens)[-1].tolist()
        else:
            tokens = expected_tokens(acceptance).tolist()
        all_accepted = tokens[drafted] - tokens[drafted - 1]  # the chance that every draft so far is accepted
        spent = self._draft_seconds(drafted)  # sunk for every choice of k
        position = self._draft_seconds(1) - self._draft_seconds(0)
        best_now = max(tokens[k] / (spent + verify[k]) for k in range(drafted + 1))
        best_later = max(
            (tokens[drafted] + all_accepted * n) / (spent + n * position + verify[drafted + n])
            for n in range(1, self.cap - drafted + 1)
        )
        return best_later > best_now

    # ------------------------------------------------------------------------------------------------- learning
    def observe(
        self,
        *,
        drafted: bool,
        verified: int,
        accepted: int | list[int],
        verify_seconds: float,
        backbone_seconds: float = 0.0,
        rollout_seconds: float = 0.0,
        positions: int = 0,
        row_verified: list[int] | None = None,
        rows: list[int] | None = None,
        tokens: int | None = None,
    ) -> None:
        """Learns from one cycle: `verified` drafts were offered, the first `accepted` of them matched, in a forward of
        `tokens` per row (default `1 + verified`; a tree's is wider, see `take_branch`).

        For a batch, `accepted` and `row_verified` hold each row's numbers and `verified` is the widest row's;
        `rows` says which rows of the block they describe, when not all (rows that verified copies instead). With
        `rooms` set, the measured tokens are discounted as `expected_tokens` prices them (by when the last row
        finishes), so that measured and predicted rates compare.
        """
        record = self.record
        if self.rooms is not None and drafted and verified:  # priced before this cycle's outcome is learned
            learned = torch.tensor(record.position_acceptance[: max(self.cap, 1)])
            discount = float(self._tokens(learned)[verified] / expected_tokens(learned)[verified])
        else:
            discount = 1.0
        accepted_rows = [accepted] if isinstance(accepted, int) else list(accepted)
        verified_rows = [verified] * len(accepted_rows) if row_verified is None else list(row_verified)
        confidence_rows = (
            self.confidence if self.confidence is None or self.confidence.dim() == 2 else [self.confidence]
        )
        if rows is not None and confidence_rows is not None:
            confidence_rows = [confidence_rows[row] for row in rows]
        # A call's first drafting cycle reads the prompt's whole context and, first in a process, pays one-time work
        # (kernel set-up, packing a draft vocabulary's rows: 0.7-1.3 s on a CPU): its times are not the drafter's cost.
        first_draft = drafted and not self.drafted_before
        self.drafted_before |= drafted
        learn_draft_times = self.learn_times and not first_draft
        forward_tokens = tokens or 1 + verified
        if self.learn_times:
            self.verify_cost.observe(forward_tokens, verify_seconds)
            if drafted and learn_draft_times:
                # A backbone time estimated before this setting drafted is replaced by its first measurement; the
                # rollout's keeps bounded steps (a first cycle at a new width can capture a CUDA graph).
                prior = record.backbone_from_prior
                record.backbone_seconds = _learned_time(record.backbone_seconds, backbone_seconds, replace=prior)
                record.backbone_from_prior = False
                if positions:
                    record.position_seconds = _learned_time(record.position_seconds, rollout_seconds / positions)
        for row, (row_accepted, offered) in enumerate(zip(accepted_rows, verified_rows)):
            confidence = None if confidence_rows is None else confidence_rows[row]
            learn_acceptance(record, offered, row_accepted, confidence)
        if not drafted:
            return
        if learn_draft_times:
            elapsed = backbone_seconds + rollout_seconds + verify_seconds
        else:  # host timings are not the device's, or not typical: judge the cycle by the cost model
            elapsed = self.cycle_seconds(positions, verified, forward_tokens)
        earned = (sum(accepted_rows) / len(accepted_rows) + 1) * discount
        cycle_rate = earned / max(elapsed, 1e-9)
        # A probe's own cycle is the freshest evidence there is after a pause: it replaces the stale estimate.
        record.drafting_rate = cycle_rate if self.probing else _moved(record.drafting_rate, cycle_rate, RATE_RATE)
        # One cycle of one sequence is a coin toss (a drafter accepting 40% of first drafts fails most cycles yet pays
        # on average where a cycle costs little more than a plain step): after verifying drafts, pause only when the
        # acceptance learned per position, through the cost model, also says that drafting does not pay. A cycle over
        # BATCH_EVIDENCE_ROWS rows or more averages their outcomes: its measured rate is evidence enough.
        plain_rate = 1 / self.verify_cost(1)
        averaged = len(accepted_rows) >= BATCH_EVIDENCE_ROWS  # rows of the batch in this cycle
        evidence = not verified or averaged or not self._pays(record.position_acceptance)
        if record.drafting_rate < plain_rate and evidence:
            # Back off only after a failed probe; the first failure starts with a one-step pause. The long-run
            # acceptance keeps pauses short for one sequence; a batch's measured rates alone set them.
            steady = record.steady_acceptance if record.steady_cycles >= STEADY_CYCLES and not averaged else None
            longest = STEADY_SKIP_INTERVAL if steady is not None and self._pays(steady) else MAX_SKIP_INTERVAL
            record.skip_interval = min(2 * record.skip_interval, longest) if self.probing else 1
            record.skip_left = record.skip_interval
        else:
            record.skip_interval, record.skip_left = 1, 0


def tree_tokens(acceptance: torch.Tensor, price: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`E(k)` of a tree, k = 0..K, verifying its first 1..n branches: `[n, K + 1]`.

    `acceptance` `[rows, n, K]` is each branch's, as for a block; `price` turns a block's `[rows, K]` into its
    `E(k)` (`expected_tokens`, or the policy's pricing by makespan). A row's branches start with different tokens, so
    at most one first draft is right: their first acceptances are scaled to sum to at most 1, and each further branch
    adds the drafts it would have accepted (its `E(k) - E(0)`) to the first's.
    """
    first = acceptance[..., :1]
    acceptance = torch.cat([first / first.sum(dim=1, keepdim=True).clamp(min=1.0), acceptance[..., 1:]], dim=-1)
    tokens = torch.stack([price(acceptance[:, b]) for b in range(acceptance.shape[1])])
    return torch.cat([tokens[:1], tokens[1:] - tokens[1:, :1]]).cumsum(dim=0)


def learn_acceptance(
    record: DrafterRecord, offered: int, accepted: int, confidence: torch.Tensor | None = None
) -> None:
    """Learns from one row of one cycle: `offered` drafts were verified, the first `accepted` of them matched."""
    if not offered:
        return
    seen = min(offered, accepted + 1)  # drafts after the first rejection were never judged
    outcomes = torch.arange(seen) < accepted
    rate = SAMPLED_POSITION_RATE if record.sampled else POSITION_RATE
    if record.steady_acceptance is None:
        record.steady_acceptance = list(record.position_acceptance)
    record.steady_cycles += 1
    for j in range(seen):
        current = record.position_acceptance[j]
        record.position_acceptance[j] = current + rate * (float(outcomes[j]) - current)
        steady = record.steady_acceptance[j]
        record.steady_acceptance[j] = steady + STEADY_RATE * (float(outcomes[j]) - steady)
    if confidence is not None:
        record.calibration.observe(confidence[:seen], outcomes)


class LookupPolicy:
    """How many drafts copied from the text (`copied_drafts_domino.lookup_drafts`) to verify.

    Copying costs nothing next to a target forward, so there is no drafting time to learn and nothing to pause: of
    the drafts found, verify the k that maximizes `E(k) / T_verify(k)` by the acceptance seen per position of such
    drafts (learned like a drafter's, in its own record) and the target's verify-cost table. 0 when that rate does
    not beat the alternative (when sampling, copies are accepted only as often as the target draws them, and the
    drafter usually does better); the drafter then drafts as usual.
    """

    def __init__(self, record: DrafterRecord, verify_cost: VerifyCost | None, learn_times: bool | None = None):
        self.record, self.verify_cost = record, verify_cost
        self.learn_times = LEARN_TIMES if learn_times is None else learn_times

    def choose(
        self,
        num_found: int | list[int],
        rival_rate: float = 0.0,
        sources: list[LookupPolicy] | None = None,
        rooms: list[int] | None = None,
        paces: list[float] | None = None,
    ) -> int:
        """How many of `num_found` copied drafts to verify; 0 where a cycle of them is not expected to earn more
        tokens per second than `rival_rate` (the drafter's best, or a plain step's).

        For a batch, `num_found` lists each row's copies (0 for a row without) and the answer is the width W of the
        verified rectangle, each row offering `min(found, W)`: every row pays for the width, so copies in a few rows
        of a large batch rarely pay, and rows without copies count as plain steps. `sources[row]` is the policy
        whose acceptance a row's copies have (copied from the text, or retrieved from a datastore); default this one.
        With `rooms` (the tokens each row may still generate) and `paces`, W is priced by the time it saves a batch
        that is done when its last row is.
        """
        found = [num_found] if isinstance(num_found, int) else num_found
        if self.verify_cost is None:  # a fixed policy: verify every draft found
            return max(found)
        widest = max(found)
        records = [source.record for source in sources] if sources is not None else [self.record] * len(found)
        acceptance = torch.tensor([record.position_acceptance[:widest] for record in records], dtype=torch.float64)
        for row, n in enumerate(found):
            acceptance[row, n:] = 0  # a row's copies end: past them it only adds the target's token
        tokens = expected_tokens(acceptance, rooms, paces, self.verify_cost.fixed_share)  # as the rival counts them
        costs = torch.tensor([self.verify_cost(1 + k) for k in range(len(tokens))], dtype=torch.float64)
        rates = tokens / costs
        best = int(torch.argmax(rates))
        return best if float(rates[best]) > rival_rate else 0

    def observe(self, *, verified: int, accepted: int, verify_seconds: float | None = None) -> None:
        """Learns from copies verified in a forward that took `verify_seconds`, or, without it, from copies declined
        and compared with the tokens generated instead (exact: copies are deterministic, so the first `accepted` of
        `verified` would have been accepted), so a source once judged poor keeps being judged."""
        if self.verify_cost is not None and self.learn_times and verify_seconds is not None:
            self.verify_cost.observe(1 + verified, verify_seconds)
        learn_acceptance(self.record, verified, accepted)


def _moved(current: float | None, observed: float, rate: float) -> float:
    return observed if current is None else current + rate * (observed - current)


def _learned_time(current: float | None, observed: float, replace: bool = False) -> float:
    """A drafting time moved towards one cycle's, which counts as at most twice (at least half) the estimate, as
    `VerifyCost.observe` bounds a verification: a one-off (a CUDA graph captured for a longer block, a stall of the
    machine) must not price the drafter for many cycles. With `replace` (the estimate was never measured in this
    setting), the cycle's time itself."""
    if replace:
        return observed
    if current is not None and current > 0:
        observed = min(max(observed, current / 2), current * 2)
    return _moved(current, observed, TIME_RATE)


__all__ = ["AdaptivePolicy", "FixedPolicy", "LookupPolicy", "below_threshold", "learn_acceptance", "tree_tokens"]
