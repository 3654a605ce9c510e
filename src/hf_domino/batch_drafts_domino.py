"""The drafting half of a batch's cycle: what each row offers for verification, its drafted block or copied drafts.

`CycleDrafter` drafts one block for every active row of `batching_domino.BatchedDecoding` and chooses, with the
drafter's policy, how many drafts to verify; `row_limits` says how many drafts each row may offer (its room, its
confident drafts, none past a stop string). A row whose text repeats offers copies instead, as at batch 1
(`RowCopies`: what followed its last n-gram, else what the drafter's datastore continues it with), priced for all rows
together. `CycleDrafts` holds the result for the verification.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .batch_policy_domino import batch_policy
from .copied_drafts_domino import lookup_drafts
from .drafting_domino import (
    drafting_vocab,
    drafts_through_an_end,
    score_only,
    select_fused_rollout,
    spread_to_vocabulary,
    stop_free_length,
)
from .options_domino import checked_datastore
from .policy_domino import LookupPolicy, below_threshold
from .ragged_batch_domino import BatchDrafts, batched_rollout, run_batched_backbone
from .records_domino import DraftingMode, copy_records

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.generation.logits_process import LogitsProcessorList

    from .copied_drafts_domino import DraftDatastore
    from .modeling_domino import DominoForSpeculation, TargetModules
    from .options_domino import DominoOptions
    from .policy_domino import AdaptivePolicy, FixedPolicy
    from .ragged_batch_domino import BatchedDrafterContext
    from .ragged_cache_domino import RaggedCache


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
        """`[rows, branches]`: the drafts each row offers in each branch (a block: one column). On the host."""
        if self.branches is None:
            return self.lengths[:, None]
        return torch.cat([self.lengths[:, None], self.branch_lengths], dim=1)

    def verified(self) -> list[int]:
        """Per row, the drafts its verification offered: its block's, in a tree the branch it went on along."""
        if self.drafts is None and not self.copies:  # a plain step
            return [0] * len(self.lengths)
        return [row[taken] for row, taken in zip(self.offered().tolist(), self.taken or [0] * len(self.lengths))]

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
    drafts: BatchDrafts,
    sequences: list[torch.LongTensor],
    room: list[int],
    threshold: float | None,
    criteria: list,
    ends: torch.Tensor | None = None,
) -> list[int]:
    """Drafts each active row (`sequences`, in the batch's order) may offer: its room, its drafts through the first
    under the confidence threshold, none after one that completes a stop (`criteria[i]`: row i's stopping criteria
    asked inside a block; the loop cuts an accepted block there, `BatchedDecoding.extend`) or after an EOS draft
    (`ends`: the EOS token ids). Each draft's offer depends on the drafts before it only, as sampling needs."""
    through_end = drafts_through_an_end(drafts.ids, ends) if ends is not None else [drafts.ids.shape[1]] * len(room)
    return [
        stop_free_length(
            criteria[i],
            sequence,
            drafts.ids[i],
            min(room[i], below_threshold(drafts.confidence[i], threshold), end),
            through_stop=True,
        )  # fmt: skip
        for i, (sequence, end) in enumerate(zip(sequences, through_end, strict=True))
    ]


class RowCopies:
    """Copied drafts for a batch's rows, as at batch 1: where a row's text repeats, what followed its last n-gram;
    else, with a datastore, what the target's earlier answers continue it with. `padding[row]` is each row's left
    padding, never copied from; `criteria[row]` the row's stopping criteria that must not fire inside a block, `ends`
    the EOS token ids (a copy ends at one). The two sources' policies are set by `CycleDrafter.build_policies` with the
    drafter's (they share its verify-cost table)."""

    def __init__(
        self,
        datastore: DraftDatastore | None,
        max_copies: int,
        padding: list[int],
        criteria: list,
        ends: torch.Tensor | None = None,
    ):
        self.datastore, self.max_copies, self.padding, self.criteria = datastore, max_copies, padding, criteria
        self.ends = ends
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

        Rows copy where their text repeats, else retrieve where `retrieving`, cut before a stop string and after an EOS
        as drafts are.
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
                keep = stop_free_length(self.criteria[row], sequences[row], copy[0], ends=self.ends, through_stop=True)
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


class CycleDrafter:
    """The drafting half of a batch's cycle: the drafter's policy, the rows' copied drafts and their policies, and the
    Domino head's rollout (fused where the call allows it). `draft` returns a cycle's `CycleDrafts`; `learn` teaches
    the policies what its verification found. The loop (`batching_domino.BatchedDecoding`) keeps the rows, both caches
    (it hands `context`, the drafter's, over) and the verification.

    `process(logits, extra, repeats)` runs the active rows' logits processors (the loop's rows), which `per_row`
    holds (one list per row, growing in place as a server's rows join); `clock()` reads the time as the loop does.
    """

    def __init__(
        self,
        drafter: DominoForSpeculation,
        modules: TargetModules,
        options: DominoOptions,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList,
        block_criteria: list,
        context: BatchedDrafterContext,
        process: Callable[..., torch.Tensor],
        clock: Callable[[], float],
        padding: list[int],
        per_row: list[LogitsProcessorList],
        timings: dict[str, list[float]] | None = None,
        ends: torch.Tensor | None = None,
    ):
        self.drafter, self.modules, self.options, self.context = drafter, modules, options, context
        self.block_criteria, self.process, self.clock, self.timings = block_criteria, process, clock, timings
        self.per_row = per_row
        self.ends = ends  # the EOS ids the call's criteria end a row at: its drafts end at one (`row_limits`)
        self.do_sample = bool(generation_config.do_sample)
        self.head = options.head_enabled(drafter)
        # The EOS ids the processors read are the config's (a length penalty's), whatever the criteria end rows at.
        self.vocab = drafting_vocab(
            drafter.draft_vocab if options.draft_vocab else None, logits_processor,
            getattr(generation_config, "_eos_token_tensor", None),
        )  # fmt: skip
        self.max_drafts = options.drafts_per_block(drafter)
        # Drafts are picked from the base (+ head) logits themselves when greedy without processors; else from the
        # processed logits, over the draft vocabulary's columns where the processors read the scores alone.
        self.plain_greedy = not self.do_sample and not len(logits_processor)
        self.pick_on_columns = self.vocab is not None and score_only(logits_processor)
        # A tree of first-token branches per block (`domino_branches`).
        self.branches = options.domino_branches
        # The fused head (one launch per kernel for all rows, a tree's branches among them, and a CUDA graph) where the
        # call allows it, else None: the eager `batched_rollout`.
        self.fused_rollout = select_fused_rollout(
            drafter, modules, options, do_sample=self.do_sample, logits_processor=logits_processor,
            max_drafts=self.max_drafts,
        )  # fmt: skip
        self.policy: AdaptivePolicy | FixedPolicy | None = None
        # Copied drafts, as at batch 1: off with the ensemble option, capped by transformers' prompt-lookup length
        # (their policies are built with the drafter's, `build_policies`).
        self.copies: RowCopies | None = None
        if options.domino_lookup and generation_config.assistant_ensemble_weight is None:
            self.copies = RowCopies(
                datastore=checked_datastore(drafter) if options.domino_datastore else None,
                max_copies=min(self.max_drafts, generation_config.prompt_lookup_num_tokens or self.max_drafts),
                padding=padding,
                criteria=block_criteria,
                ends=self.ends,
            )

    def build_policies(
        self, target: PreTrainedModel, target_cache: RaggedCache, anchors: torch.LongTensor, hidden_layers
    ) -> None:
        """The drafter's policy and those of copied and retrieved drafts, whose acceptance is shared with batch 1."""
        mode = DraftingMode(sampled=self.do_sample, head=self.head, vocab=self.vocab is not None)
        forward_kwargs = {"output_hidden_states": hidden_layers}
        self.policy = batch_policy(
            target, self.drafter, self.options, mode, target_cache, anchors, forward_kwargs, self.max_drafts
        )
        if self.copies is not None:
            lookup_record, datastore_record = copy_records(self.drafter, target, self.do_sample)
            # The drafter's policy learns the verify times (copies share its table and forwards).
            cost = self.policy.verify_cost if self.policy.adaptive else None
            self.copies.lookup_policy = LookupPolicy(lookup_record, cost, False)
            self.copies.datastore_policy = LookupPolicy(datastore_record, cost, False)

    def index_datastore(self) -> None:
        """Builds the datastore's retrieval index where the call retrieves (once per datastore): before the first timed
        cycle, not inside it."""
        if self.copies is not None and self.copies.datastore is not None:
            self.copies.datastore.build_index()

    @property
    def lookup_policy(self) -> LookupPolicy | None:
        """The policy of copied drafts (None: the call does not copy)."""
        return None if self.copies is None else self.copies.lookup_policy

    @property
    def datastore_policy(self) -> LookupPolicy | None:
        """The policy of drafts retrieved from the datastore (None: the call does not copy)."""
        return None if self.copies is None else self.copies.datastore_policy

    def find_copies(
        self,
        sequences: list[torch.LongTensor],
        active: list[int],
        room: list[int],
        retrieving: bool,
        rooms: list[int] | None,
        paces: list[float] | None,
    ) -> tuple[dict, dict, dict]:
        """Per active row, the copied drafts it offers this cycle, the copies the lookup policy declined, and each
        row's source (`RowCopies.find`)."""
        if self.copies is None:
            return {}, {}, {}
        return self.copies.find(sequences, active, room, self.policy, retrieving, rooms, paces)

    def draft(
        self,
        anchors: torch.LongTensor,
        sequences: list[torch.LongTensor],
        active: list[int],
        room: list[int],
        copying: set[int],
        per_row_k: bool = False,
    ) -> CycleDrafts:
        """The policy's budget, one block for every active row (`sequences[row]` for each row of `active`), and how
        many drafts each row offers.

        Rows in `copying` (by place in `active`) offer copies instead; when every row does, the drafter does not run.
        `per_row_k`: the adaptive policy chooses each row's k on its own, not one for the batch.
        """
        start = self.clock()
        rows = len(active)
        budget = 0 if len(copying) == rows else self.policy.budget(max(room))
        if budget <= 0:
            return CycleDrafts.plain(rows)
        hidden = run_batched_backbone(self.drafter, self.modules, anchors, self.context, budget)
        backbone_done = self.clock()
        base_logits = self.modules.logits(hidden, self.vocab).float()
        lm_head_done = self.clock()
        drafts, branches = self.roll_out(hidden, base_logits, anchors, active)
        drafted = self.clock()
        threshold = self.options.assistant_confidence_threshold
        sequences, criteria = [sequences[row] for row in active], [self.block_criteria[row] for row in active]
        limits = row_limits(drafts, sequences, room, threshold, criteria, self.ends)
        limits = [0 if i in copying else limit for i, limit in enumerate(limits)]
        tree = None
        if branches is not None:
            tree = torch.cat(
                [torch.tensor(limits)[:, None], self.branch_limits(branches, sequences, room, copying, criteria)], 1
            )
            confidence = torch.cat([drafts.confidence[:, None], branches.confidence], dim=1)
            width, used = self.policy.choose_tree(confidence, drafted - start, tree)
            lengths = tree[:, 0].clamp(max=width).tolist()
            tree = tree[:, 1:used].clamp(max=width) if used > 1 and width and tree[:, 1:used].any() else None
        elif per_row_k and self.policy.adaptive:
            lengths = [
                self.policy.choose(drafts.confidence[i : i + 1], drafted - start, [n]) for i, n in enumerate(limits)
            ]
            self.policy.confidence = drafts.confidence.detach().float().cpu()  # what observe() learns from
        else:
            width = self.policy.choose(drafts.confidence, drafted - start, limits=limits)
            lengths = [min(width, limit) for limit in limits]
        if self.timings is not None:
            for name, seconds in (
                ("backbone", backbone_done - start),
                ("lm_head", lm_head_done - backbone_done),
                ("head", drafted - lm_head_done),
            ):
                self.timings.setdefault(name, []).append(seconds)
        observed = {
            "drafted": True,
            "positions": drafts.ids.shape[1],
            "backbone_seconds": backbone_done - start,
            "rollout_seconds": drafted - backbone_done,
        }
        cycle = CycleDrafts(drafts, torch.tensor(lengths, dtype=torch.long), observed)
        if tree is not None:
            cycle.branches, cycle.branch_lengths = branches.ids[:, : tree.shape[1]], tree
            cycle.branch_logits = None if branches.logits is None else branches.logits[:, : tree.shape[1]]
        return cycle

    def branch_limits(
        self,
        branches: BatchDrafts,
        sequences: list[torch.LongTensor],
        room: list[int],
        copying: set[int],
        criteria: list,
    ) -> torch.LongTensor:
        """`[rows, n - 1]`: the drafts each row may offer in a tree's other branches, each limited as a block is
        (room, confidence, stop strings: its own drafts); none where the row copies."""
        threshold = self.options.assistant_confidence_threshold
        limits = [
            row_limits(branches.branch(b), sequences, room, threshold, criteria, self.ends)
            for b in range(branches.ids.shape[1])
        ]
        lengths = torch.tensor(limits, dtype=torch.long).T
        lengths[sorted(copying)] = 0
        return lengths

    def pick_logits(self, logits: torch.Tensor, drafted: torch.LongTensor, repeats: int = 1) -> torch.Tensor:
        """The distribution a draft is picked from when drafting is not plain greedy: the processed logits, over the
        draft vocabulary's columns where the processors read the scores alone (as `processed_pick` does)."""
        if not self.pick_on_columns:
            logits = spread_to_vocabulary(logits, self.vocab, self.drafter.config.vocab_size)
        return self.process(logits.float(), drafted, repeats)

    def roll_out(
        self, hidden: torch.Tensor, base_logits: torch.Tensor, anchors: torch.LongTensor, active: list[int]
    ) -> tuple[BatchDrafts, BatchDrafts | None]:
        """The Domino head over the block of every row of `active`: fused when `generate()` allows it (and, when
        sampling, each row's processors do: a server's requests bring their own settings), else eager.

        With `domino_branches` n > 1, n blocks per row, the head continuing each of the row's n likeliest first
        drafts: the first block, and the others (`ids`, `confidence` `[rows, n - 1, k]`); else (the block, None).
        """
        n, rows = self.branches, anchors.shape[0]
        if n > 1:  # each row's block n times in a row, one per branch
            hidden, base_logits = hidden.repeat_interleave(n, dim=0), base_logits.repeat_interleave(n, dim=0)
            anchors = anchors.repeat_interleave(n, dim=0)
        processors = [self.per_row[row] for row in active for _ in range(n)] if self.do_sample else None
        fused = self.fused_rollout is not None and (processors is None or self.fused_rollout.draws_under(processors))
        if fused:
            ids, logits, confidence = self.fused_rollout.draft_rows(
                hidden, base_logits, self.vocab, anchors, processors
            )
            drafts = BatchDrafts(ids, logits if self.do_sample else None, confidence)
        else:
            drafts = batched_rollout(
                self.drafter, self.modules, hidden, base_logits, self.vocab, anchors,
                head=self.head, do_sample=self.do_sample,
                pick_logits=None if self.plain_greedy else functools.partial(self.pick_logits, repeats=n),
                keep_rolling=self.policy.keep_rolling if self.policy.adaptive else None,
                branches=n,
            )  # fmt: skip
        if n == 1:
            return drafts, None
        ids, confidence = drafts.ids.view(rows, n, -1), drafts.confidence.view(rows, n, -1)
        logits = None if drafts.logits is None else drafts.logits.view(rows, n, *drafts.logits.shape[1:])
        return (
            BatchDrafts(ids[:, 0], None if logits is None else logits[:, 0], confidence[:, 0]),
            BatchDrafts(ids[:, 1:], None if logits is None else logits[:, 1:], confidence[:, 1:]),
        )

    def learn(self, cycle: CycleDrafts, matches: list[int], offered: list[int], verify_seconds: float) -> None:
        """Copied rows teach their source's policy; the drafter's policy learns from the rows it drafted for alone (and
        the forward's time from all of them), in a tree along the branch each row took (`offered`: the drafts each
        row offered there)."""
        for row, copy in cycle.copies.items():
            cycle.sources[row].observe(verified=copy.shape[0], accepted=matches[row])
        if cycle.taken is not None:
            self.policy.take_branch(cycle.taken, cycle.offered())
        drafted = [row for row in range(len(matches)) if row not in cycle.copies]
        self.policy.observe(
            verified=cycle.width, accepted=[matches[row] for row in drafted],
            row_verified=[offered[row] for row in drafted], rows=drafted, verify_seconds=verify_seconds,
            tokens=cycle.columns, **cycle.observed,
        )  # fmt: skip


__all__ = ["CycleDrafter", "CycleDrafts", "RowCopies", "row_limits"]
