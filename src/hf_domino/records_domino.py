"""What the draft policies learn about a drafter and keep for the process, across `generate()` calls.

One `DrafterRecord` per drafter, target and `DraftingMode` (whose drafts, drawn or picked, head, vocabulary,
branches, batch size): the acceptance seen per draft position, a confidence calibration (`AcceptanceCalibration`), the
drafter's times, whether drafting has been paying and the pause it set; for batches, what whole calls gained. The
policies (`policy_domino`, `batch_policy_domino`) read and teach them; `forget_records(drafter)` starts a drafter
afresh. Records are kept in weak dictionaries keyed by the drafter, then the target, so they go with either: what one
target taught (its drafts rejected, drafting paused) does not hold back the drafter beside another.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

# What a drafter is assumed to achieve at a draft position before anything was observed there: optimistic, so that
# the first blocks are long enough to show how far its drafts hold.
INITIAL_ACCEPTANCE = 0.8
CALIBRATION_BINS = 10


# --------------------------------------------------------------------------------------------------- calibration
class AcceptanceCalibration:
    """P(draft accepted | its confidence, the drafts before it accepted), by confidence bin, learned online.

    Each bin starts as if it had seen two drafts accepted at the bin's mean confidence, so an unseen bin trusts the
    drafter; observations then pull it towards what the target actually accepts.
    """

    def __init__(self, bins: int = CALIBRATION_BINS, prior_weight: float = 2.0):
        centers = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
        self.accepted = centers * prior_weight
        self.trials = torch.full((bins,), prior_weight, dtype=torch.float64)

    def _bins(self, confidence: torch.Tensor) -> torch.Tensor:
        bins = self.trials.numel()
        return (confidence.double().cpu() * bins).long().clamp_(0, bins - 1)

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance probability for each confidence in `[k]`."""
        index = self._bins(confidence)
        return self.accepted[index] / self.trials[index]

    def observe(self, confidence: torch.Tensor, accepted: torch.Tensor) -> None:
        index = self._bins(confidence)
        self.trials.index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
        self.accepted.index_add_(0, index, accepted.double().cpu())


# ------------------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class DraftingMode:
    """What a record is learned for: whose drafts (the drafter's, copies from the text, retrievals from the
    datastore), drawn or picked, with the Domino head, over a draft vocabulary, in trees of how many first-token
    branches, and for batches of how many rows (None: one sequence's loop)."""

    source: str = "drafter"
    sampled: bool = False
    head: bool = False
    vocab: bool = False
    branches: int = 1
    rows: int | None = None

    @property
    def drawn(self) -> bool:
        """The drafter's own drafts drawn at random: each is accepted by a coin toss (min(1, p/q)), so one cycle says
        little about the next, and the record learns at SAMPLED_POSITION_RATE. Copies are the text's, not drawn."""
        return self.sampled and self.source == "drafter"


@dataclass
class DrafterRecord:
    """What the adaptive policy has learned about one drafter in one decoding mode, kept across calls."""

    position_acceptance: list[float]
    sampled: bool = False  # the drafter's own drafts, drawn (`DraftingMode.drawn`): learned at SAMPLED_POSITION_RATE
    calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    backbone_seconds: float | None = None
    position_seconds: float | None = None
    # The backbone's time was estimated from another setting (a new batch size from batch 1), not measured in this one.
    backbone_from_prior: bool = False
    drafting_rate: float | None = None  # tokens/s of recent drafting cycles, drafting included
    skip_interval: int = 1
    skip_left: int = 0
    steady_acceptance: list[float] | None = None  # like position_acceptance, learned slowly (STEADY_RATE)
    steady_cycles: int = 0  # drafting cycles behind steady_acceptance
    # Batches only (`batch_policy_domino.judge_call`): a plain cycle's time by the number of active rows,
    # what speculating calls gained over plain steps (averaged over calls), and how many of the next calls take plain
    # steps only (after how many the last time).
    plain_cycle_seconds: dict[int, float] = field(default_factory=dict)
    call_gain: float | None = None
    plain_calls: int = 0
    plain_calls_left: int = 0


_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def drafter_record(
    drafter: torch.nn.Module, target: torch.nn.Module, mode: DraftingMode, num_drafts: int
) -> DrafterRecord:
    """What the policies have learned with `drafter` drafting for `target` in `mode`, kept for the process (new:
    nothing learned yet)."""
    records = _RECORDS.setdefault(drafter, weakref.WeakKeyDictionary()).setdefault(target, {})
    if mode not in records:
        records[mode] = DrafterRecord(position_acceptance=[INITIAL_ACCEPTANCE] * num_drafts, sampled=mode.drawn)
    return records[mode]


def forget_records(drafter: torch.nn.Module) -> None:
    """Forgets what the policies learned with `drafter` (acceptance, times, pauses): its next call starts as its first
    (the target's verify-cost table stays)."""
    _RECORDS.pop(drafter, None)


def copy_records(
    drafter: torch.nn.Module, target: torch.nn.Module, do_sample: bool
) -> tuple[DrafterRecord, DrafterRecord]:
    """What copies from the text and retrievals from the datastore have earned with `drafter` and `target` in this
    decoding mode: one record each, shared by batch 1 and batches."""
    num_drafts = drafter.config.num_drafts
    return tuple(
        drafter_record(drafter, target, DraftingMode(source, do_sample), num_drafts)
        for source in ("lookup", "datastore")
    )


__all__ = [
    "INITIAL_ACCEPTANCE",
    "AcceptanceCalibration",
    "DrafterRecord",
    "DraftingMode",
    "copy_records",
    "drafter_record",
    "forget_records",
]
