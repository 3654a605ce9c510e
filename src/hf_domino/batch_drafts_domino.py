"""What one cycle of a batch offers for verification: per row, its drafted block or copied drafts, and how many.

`batching_domino.BatchedDecoding` drafts one block for every active row; `row_limits` says how many drafts each row
may offer (its room, its confident drafts, none past a stop string). A row whose text repeats offers copies instead,
as at batch 1 (`RowCopies`: what followed its last n-gram, else what the drafter's datastore continues it with),
priced for all rows together. `CycleDrafts` holds the result for the verification.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .drafting_domino import lookup_drafts, stop_free_length
from .policy_domino import below_threshold

if TYPE_CHECKING:
    from .drafting_domino import DraftDatastore
    from .policy_domino import AdaptivePolicy, FixedPolicy, LookupPolicy
    from .ragged_batch_domino import BatchDrafts


@dataclass
class CycleDrafts:
    """What the drafting half of a cycle produced: the drafts, how many each row offers, and what it cost.

    A row in `copies` offers those copied drafts instead of its drafted block (`lengths` counts them). A tree
    (`domino_branches`) also has `branches`, the other branches' drafts, and how many of each a row offers.
    """

    drafts: BatchDrafts | None
    lengths: torch.LongTensor  # [rows]: drafts offered by each row (0: a plain step for that row)
    observed: dict[str, Any] = field(default_factory=dict)  # for the policy's observe()
    copies: dict[int, torch.LongTensor] = field(default_factory=dict)  # row -> its copied drafts
    sources: dict[int, LookupPolicy] = field(default_factory=dict)  # row -> the policy of its copies' source
    branches: torch.LongTensor | None = None  # [rows, n - 1, k]: a tree's branches after the first (`drafts`)
    branch_lengths: torch.LongTensor | None = None  # [rows, n - 1]: drafts each row offers in each of them
    branch_logits: torch.Tensor | None = None  # [rows, n - 1, k, V]: what their drafts were drawn from (sampling)
    taken: list[int] | None = None  # per row, the branch its verification went on along (set by the verification)

    @classmethod
    def plain(cls, rows: int) -> CycleDrafts:
        """A plain target step for every row: nothing drafted, nothing copied."""
        return cls(None, torch.zeros(rows, dtype=torch.long), {"drafted": False})

    def offered(self) -> torch.LongTensor:
        """`[rows, branches]`: the drafts each row offers in each branch (a block: one column)."""
        if self.branches is None:
            return self.lengths[:, None]
        return torch.cat([self.lengths[:, None], self.branch_lengths], dim=1)

    @property
    def width(self) -> int:
        """Drafts per branch the forward verifies: the most any row offers."""
        offered = self.offered()
        return int(offered.max()) if offered.numel() else 0

    @property
    def columns(self) -> int:
        """Tokens per row in the verifying forward: the anchor, then `width` per branch."""
        return 1 + self.width * (1 if self.branches is None else 1 + self.branches.shape[1])

    def draft_logits(self) -> torch.Tensor | None:
        """`[rows, width, V]` (at most): the processed logits each row's drafts were drawn from (sampling only), along
        the branch it took in a tree."""
        if self.drafts is None or self.drafts.logits is None:
            return None
        if self.taken is None:
            return self.drafts.logits[:, : self.width]
        every = torch.cat([self.drafts.logits[:, None], self.branch_logits], dim=1)
        return every[torch.arange(every.shape[0]), self.taken][:, : self.width]

    def take_copies(self, copies: dict[int, torch.LongTensor], sources: dict[int, LookupPolicy]) -> None:
        """Rows that copy offer their copies instead of their drafts (in a tree: as its only branch)."""
        self.copies, self.sources = copies, sources
        for row, copy in copies.items():
            self.lengths[row] = copy.shape[0]
            if self.branch_lengths is not None:
                self.branch_lengths[row] = 0

    def copied(self, rows: int, source: LookupPolicy | None = None) -> list[bool]:
        """Per row, whether it offers copies (from `source` only, when given)."""
        return [row in self.copies and source in (None, self.sources[row]) for row in range(rows)]

    def candidates(self, anchors: torch.LongTensor) -> torch.LongTensor:
        """`[rows, width]`: each row's drafted or copied drafts; columns past a row's length are never read."""
        ids = anchors.new_zeros(anchors.shape[0], self.width)
        if self.drafts is not None:
            drafted = self.drafts.ids[:, : self.width].to(ids.device)
            ids[:, : drafted.shape[1]] = drafted
        for row, copy in self.copies.items():
            ids[row, : copy.shape[0]] = copy.to(ids.device)
        return ids


def row_limits(
    drafts: BatchDrafts, sequences: list[torch.LongTensor], room: list[int], threshold: float | None, criteria: list
) -> list[int]:
    """Drafts each active row (`sequences`, in the batch's order) may offer: its room, its drafts above the confidence
    threshold, none past a stop string (`criteria`: the stopping criteria that must not fire inside a block)."""
    return [
        stop_free_length(
            criteria, sequence, drafts.ids[i], min(room[i], below_threshold(drafts.confidence[i], threshold))
        )
        for i, sequence in enumerate(sequences)
    ]


class RowCopies:
    """Copied drafts for a batch's rows, as at batch 1: where a row's text repeats, what followed its last n-gram;
    else, with a datastore, what the target's earlier answers continue it with. `padding[row]` is each row's left
    padding, never copied from; `criteria` the stopping criteria that must not fire inside a block. The two sources'
    policies are set by the batch loop once it has built the drafter's (they share its verify-cost table)."""

    def __init__(self, datastore: DraftDatastore | None, max_copies: int, padding: list[int], criteria: list):
        self.datastore, self.max_copies, self.padding, self.criteria = datastore, max_copies, padding, criteria
        self.lookup_policy: LookupPolicy | None = None
        self.datastore_policy: LookupPolicy | None = None

    def find(
        self,
        sequences: list[torch.LongTensor],
        active: list[int],
        room: list[int],
        policy: AdaptivePolicy | FixedPolicy,
        retrieving: bool,
        rooms: list[int] | None = None,
        paces: list[float] | None = None,
    ) -> tuple[dict, dict, dict]:
        """Per active row (by its place in `active`), the copied drafts it offers this cycle; or, where the lookup
        policy declined them, the copies found (to be judged against what the row generates instead); and each row's
        source (its policy).

        Rows copy where their text repeats, else retrieve where `retrieving`, cut before a stop string as drafts are.
        The lookup policy prices the copies of all rows together against the batch's verification and a drafting
        cycle of `policy` (or a plain step), by the time they save it where `rooms` (each row's tokens left, and
        `paces`) are given.
        """
        found: dict[int, torch.LongTensor] = {}
        sources: dict[int, LookupPolicy] = {}
        for i, row in enumerate(active):
            text, limit = sequences[row][None, self.padding[row] :], min(self.max_copies, room[i])
            copy, source = lookup_drafts(text, limit), self.lookup_policy
            if copy is None and self.datastore is not None and retrieving:
                copy, source = self.datastore.lookup(text, limit), self.datastore_policy
            if copy is not None:
                keep = stop_free_length(self.criteria, sequences[row], copy[0])
                if keep:
                    found[i], sources[i] = copy[0, :keep], source
        if not found:
            return {}, {}, {}
        rival = policy.rate_without_copies() if policy.adaptive else 0.0
        rows = range(len(active))
        lengths = [found[i].shape[0] if i in found else 0 for i in rows]
        sources_by_row = [sources.get(i, self.lookup_policy) for i in rows]
        width = self.lookup_policy.choose(lengths, rival, sources_by_row, rooms, paces)
        if width == 0:
            return {}, found, sources
        return {i: copy[:width] for i, copy in found.items()}, {}, sources


__all__ = ["CycleDrafts", "RowCopies", "row_limits"]
