"""A ragged batch's drafter side and acceptance: the drafter's context over every row, per-row logits and picks.

Rows of a batch accept different numbers of drafts in a cycle, so the drafter's cache has holes as the target's does
(`ragged_cache_domino.RaggedCache`): `BatchedDrafterContext` and `run_batched_backbone` run the drafter over every
row's pending context and block at once, `batched_rollout` the Domino head for all rows (or for a tree's branches),
`row_processors`/`process_rows` apply each row's logits processors to that row alone (`row_criteria` gives each row
its stopping criteria), and `accept_rows` is the acceptance rule per row. `batching_domino` runs the loop that uses
these pieces.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import _speculative_sampling

from .cache_domino import buffer_layers
from .copied_drafts_domino import certain_logits
from .drafting_domino import branch_columns, picked_probability, score_only, spread_to_vocabulary, to_vocab_ids
from .modeling_domino import TargetModules
from .ragged_cache_domino import RaggedCache, positions_from_mask
from .warpers_domino import SortFreeTopP

if TYPE_CHECKING:
    from .modeling_domino import DominoForSpeculation


# ----------------------------------------------------------------------------------------------- drafter context
@dataclass
class BatchedDrafterContext:
    """`DrafterContext` for a batch: the drafter's ragged cache and, per row, features it has not read yet (in
    pieces, as at batch 1: joined when the drafter next runs)."""

    cache: RaggedCache
    pending: list[list[torch.Tensor]]  # row b: pieces [p, context_size]
    known: torch.LongTensor  # row b: verified tokens before its anchor (the anchor's position)

    @classmethod
    def empty(cls, rows: int, device: torch.device) -> BatchedDrafterContext:
        return cls(
            cache=RaggedCache(buffer_layers(DynamicCache()), torch.zeros(rows, 0, dtype=torch.bool, device=device)),
            pending=[[] for _ in range(rows)],
            known=torch.zeros(rows, dtype=torch.long, device=device),
        )

    def append(self, features: torch.Tensor, counts: list[int]) -> None:
        """Row b's next `counts[b]` verified tokens have target features `features[b, :counts[b]]`."""
        features = features.to(self.known.device)
        for row, count in enumerate(counts):
            self.pending[row].append(features[row, :count])
        self.known += torch.tensor(counts, device=self.known.device)

    def add_rows(self, contexts: list[torch.Tensor]) -> None:
        """Rows joining the batch (`BatchedDecoding.admit`), each with its prompt's features `[p, context_size]`
        still to read; their columns in the drafter's cache are holes until then."""
        device = self.known.device
        self.cache.add_rows(
            RaggedCache(DynamicCache(), torch.zeros(len(contexts), 0, dtype=torch.bool, device=device))
        )
        self.pending += [[features] for features in contexts]
        self.known = torch.cat([self.known, torch.tensor([len(features) for features in contexts], device=device)])

    def select_rows(self, rows: torch.LongTensor) -> None:
        self.cache.select_rows(rows)
        self.pending = [self.pending[row] for row in rows.tolist()]
        self.known = self.known[rows.to(self.known.device)]


def run_batched_backbone(
    drafter: DominoForSpeculation,
    target: TargetModules,
    anchor_ids: torch.LongTensor,
    context: BatchedDrafterContext,
    num_drafts: int,
) -> torch.Tensor:
    """`run_backbone` for a batch: one forward over every row's `[pending context ; anchor, MASK, ...]`.

    Rows have different numbers of pending features; the shorter ones are padded with holes, which stay in the
    drafter's cache as holes. Returns the outputs of the first `num_drafts` draft positions, `[rows, k, hidden]`.
    """
    device, rows, block_size = drafter.device, anchor_ids.shape[0], drafter.config.block_size
    pending = [torch.cat(pieces) if pieces else None for pieces in context.pending]
    counts = torch.tensor([0 if p is None else p.shape[0] for p in pending], device=device)
    width = int(counts.max()) if rows else 0
    features = torch.zeros(rows, width, drafter.config.context_size, dtype=drafter.dtype, device=device)
    for row, piece in enumerate(pending):
        if piece is not None:
            features[row, : piece.shape[0]] = piece
    slots = torch.arange(width, device=device)
    pending_mask = slots[None] < counts[:, None]
    pending_positions = (context.known - counts)[:, None] + slots[None]
    block_positions = context.known[:, None] + torch.arange(block_size, device=device)[None]
    columns = context.cache.attention_mask(
        torch.cat([pending_mask, torch.ones(rows, block_size, dtype=torch.bool, device=device)], dim=-1)
    )
    additive = torch.zeros(rows, 1, block_size, columns.shape[1], dtype=drafter.dtype, device=device)
    additive.masked_fill_(~columns[:, None, None, :], torch.finfo(drafter.dtype).min)
    key_positions = None
    if "sliding_attention" in drafter.config.layer_types:  # each key's position, counted over the row's real columns
        key_positions = positions_from_mask(columns, context.known - columns[:, :-block_size].sum(dim=-1))
    hidden = drafter(
        drafter.embed_block(target, anchor_ids),
        features,
        torch.cat([pending_positions, block_positions], dim=-1),
        attention_mask=additive,
        past_key_values=context.cache.cache,
        num_outputs=drafter.outputs_for_drafts(num_drafts),
        key_positions=key_positions,
    )
    context.cache.appended(pending_mask)  # the forward already dropped the block's own keys/values
    context.cache.maybe_compact()
    context.pending = [[] for _ in context.pending]
    return drafter.draft_hidden_states(hidden)[:, :num_drafts]


# ------------------------------------------------------------------------------------------------ logits, per row
def row_processors(logits_processor: LogitsProcessorList, rows: int) -> list[LogitsProcessorList]:
    """The call's logits processors as each row of the batch sees them, to be called with that row alone.

    transformers' processors are shared, except those that tell the rows apart: the repetition penalty's
    `prompt_ignore_length` (one entry per row, its left padding), `prefix_allowed_tokens_fn` (called with the row's
    index in the batch, which a row processed alone would read as 0) and the prompt-wide penalties
    (`encoder_repetition_penalty`, `encoder_no_repeat_ngram_size`: one prompt per row, each shared by the row's
    `num_return_sequences`) get a copy per row that answers for that row. Any other processor (the user's own) is
    called `AtItsRow`.
    """
    views = []
    for row in range(rows):
        view = LogitsProcessorList()
        for processor in logits_processor:
            if needs_its_place(processor, rows):
                processor = AtItsRow(processor, row, rows)
            elif isinstance(processor, RepetitionPenaltyLogitsProcessor) and torch.is_tensor(
                processor.prompt_ignore_length
            ):
                processor = copy.copy(processor)
                processor.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
            elif isinstance(processor, PrefixConstrainedLogitsProcessor):
                processor = PrefixConstrainedLogitsProcessor(_for_row(processor._prefix_allowed_tokens_fn, row), 1)
            elif isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
                processor = copy.copy(processor)
                prompt = _prompt_row(row, rows, len(processor.encoder_input_ids))
                processor.encoder_input_ids = processor.encoder_input_ids[prompt : prompt + 1]
            elif isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
                processor = copy.copy(processor)
                processor.generated_ngrams = [processor.generated_ngrams[_prompt_row(row, rows, processor.batch_size)]]
                processor.batch_size = 1
            view.append(processor)
        views.append(view)
    return views


def row_criteria(criteria: list, rows: int) -> list[StoppingCriteriaList]:
    """Stopping `criteria` as each row of the batch sees them, to be called with that row alone: transformers' own
    judge a row by its tokens alone, any other is called `AtItsRow`."""
    return [
        StoppingCriteriaList(
            AtItsRow(criterion, row, rows) if needs_its_place(criterion, rows) else criterion for criterion in criteria
        )
        for row in range(rows)
    ]


def needs_its_place(hook: Callable, rows: int) -> bool:
    """Whether a logits processor or stopping criterion must be called `AtItsRow` for a batch of `rows`: a hook not of
    transformers (whose own judge a row by its tokens alone) nor the sort-free top-p standing in for one, in a batch
    of more than one row (one row's place is 0)."""
    ours = type(hook).__module__.startswith("transformers.") or isinstance(hook, SortFreeTopP)
    return rows > 1 and not ours


class AtItsRow:
    """A logits processor or stopping criterion of the user's, called for one row of a batch as the target alone
    calls it: at the row's place in a batch of the call's size, every place a copy of the row, its answer for that
    place read back.

    The batch loop hands each row its own tokens, and rows are of different lengths, so they cannot be handed
    together; a hook of the user's may keep state per place in the batch (a constraint per row, say), which a row
    handed alone would read as place 0's. One that compares rows with each other cannot be served exactly by a
    ragged batch at all (docs/usage.md, "Batches").
    """

    def __init__(self, hook: Callable, row: int, rows: int):
        self.hook, self.row, self.rows = hook, row, rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None) -> torch.Tensor:
        # Two arguments: LogitsProcessorList passes keyword arguments to processors that name more.
        if torch.is_tensor(scores):
            scores = scores.expand(self.rows, -1).clone()  # a processor may write into them
        answer = self.hook(input_ids.expand(self.rows, -1).clone(), scores)
        if not torch.is_tensor(answer) or answer.dim() == 0 or answer.shape[0] != self.rows:
            # A stopping criterion written for one sequence (`return True`): the target alone would stop every row
            # of the batch at once, a step no ragged batch reaches together.
            raise ValueError(
                f"{type(self.hook).__name__} answered {answer!r} for the whole batch, and a drafted batch needs one "
                "answer per row: its rows advance at their own pace, so it cannot stop them all at the step the "
                "target alone would. Return one entry per row (a bool tensor of input_ids.shape[0] entries), or "
                "generate one prompt at a time."
            )
        return answer[self.row : self.row + 1]


def _prompt_row(row: int, rows: int, prompts: int) -> int:
    """The prompt of the batch's row `row`: generate() builds the processors before it repeats each prompt for its
    `num_return_sequences` (rows // prompts of them, next to each other), and they map a row back the same way."""
    return row // (rows // prompts)


def _for_row(prefix_allowed_tokens_fn, row: int):
    """`prefix_allowed_tokens_fn` as the batch's row `row` calls it (generate() drafts with one beam per row)."""
    return lambda batch_id, sentence: prefix_allowed_tokens_fn(row, sentence)


def warper_settings(processors: LogitsProcessorList) -> tuple:
    """What a list of score-only warpers does to a row's scores: their kinds and settings (transformers' warpers
    are functions of their attributes), so that rows whose processors were built apart but alike share one call.
    Kept on the list, which a row holds for its life: read at every drafted position and verified column."""
    settings = getattr(processors, "warper_settings", None)
    if settings is None:
        settings = tuple((type(warper), repr(sorted(vars(warper).items()))) for warper in processors)
        processors.warper_settings = settings
    return settings


def process_by_setting(
    processors: list[LogitsProcessorList], sequences: list[torch.LongTensor], logits: torch.Tensor
) -> torch.Tensor:
    """`process_rows` for rows whose processors read the scores alone (`score_only`): one call per setting, over
    all the rows that have it. A batch's rows share theirs, unless requests set their own (a server's sampling
    settings per request: `DraftedBatchingManager.add_request`)."""
    groups: dict[tuple, list[int]] = {}
    for row, row_processors_ in enumerate(processors):
        groups.setdefault(warper_settings(row_processors_), []).append(row)
    if len(groups) == 1:
        return processors[0](sequences[0][None], logits)
    processed = torch.empty_like(logits)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        processed.index_copy_(0, index, processors[rows[0]](sequences[rows[0]][None], logits.index_select(0, index)))
    return processed


def process_rows(
    processors: list[LogitsProcessorList],
    sequences: list[torch.LongTensor],
    logits: torch.Tensor,
    extra: torch.LongTensor | None = None,
    ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Applies each row's logits processors to its row of `logits [rows, V]`, row b seeing `sequences[b] + extra[b]`.

    Each row sees exactly the input_ids the target alone would pass for it (its left-padded prompt and its tokens
    so far), so penalties and minimum lengths act per row as they would without a drafter. A row whose `extra`
    holds an EOS token (`ends`) has ended before this column, which is never generated: its logits pass unprocessed,
    since processors shown a sequence going on past its end can fail (no-repeat n-grams banning the EOS, then a
    length penalty on its `-inf`: NaN).
    """
    if not any(processors):  # no row has any
        return logits
    if all(score_only(row) for row in processors):  # they read the scores only: all rows of a setting at once
        return process_by_setting(processors, sequences, logits)
    ended = [False] * len(sequences)
    if extra is not None and ends is not None and extra.shape[1]:
        ended = torch.isin(extra, ends.to(extra.device)).any(dim=1).tolist()
    rows = []
    for row, sequence in enumerate(sequences):
        if ended[row]:
            rows.append(logits[row : row + 1])
            continue
        ids = sequence if extra is None else torch.cat([sequence, extra[row].to(sequence.device)])
        rows.append(processors[row](ids[None], logits[row : row + 1]))
    return torch.cat(rows)


def repeated_rows(
    input_ids: torch.LongTensor, mask: torch.BoolTensor
) -> tuple[torch.LongTensor | None, torch.LongTensor | None]:
    """Where rows of a prompt batch repeat one another (`num_return_sequences`' copies, or one prompt sent twice):
    the first row of each distinct prompt, and per row which of those it is; (None, None) where every row differs."""
    first: dict[tuple, int] = {}
    copies = [
        first.setdefault(tuple(token if real else None for token, real in zip(ids, reals)), row)
        for row, (ids, reals) in enumerate(zip(input_ids.tolist(), mask.tolist()))
    ]
    if len(first) == len(copies):
        return None, None
    distinct = sorted(first.values())
    position = {row: i for i, row in enumerate(distinct)}
    device = input_ids.device
    return torch.tensor(distinct, device=device), torch.tensor([position[row] for row in copies], device=device)


def pick_tokens(logits: torch.Tensor, do_sample: bool) -> torch.LongTensor:
    """One token per row from processed logits `[rows, V]`: argmax, or a draw."""
    if do_sample:
        return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)[:, 0]
    return logits.argmax(dim=-1)


@dataclass
class BatchDrafts:
    ids: torch.LongTensor  # [rows, k] (a tree's other branches: [rows, n - 1, k])
    logits: torch.Tensor | None  # [rows, k, V]: the processed logits each draft was drawn from (sampling only)
    confidence: torch.Tensor  # [rows, k] (a tree's other branches: [rows, n - 1, k])

    def branch(self, index: int) -> BatchDrafts:
        """One of a tree's branches, as a block of every row."""
        logits = None if self.logits is None else self.logits[:, index]
        return BatchDrafts(self.ids[:, index], logits, self.confidence[:, index])


def batched_rollout(
    drafter: DominoForSpeculation,
    target: TargetModules,
    hidden: torch.Tensor,
    base_logits: torch.Tensor,
    vocab: torch.Tensor | None,
    anchor_ids: torch.LongTensor,
    *,
    head: bool,
    pick_logits,
    do_sample: bool,
    keep_rolling=None,
    branches: int = 1,
) -> BatchDrafts:
    """`eager_rollout` for all rows at once: per draft position the Domino head's correction, then one pick per row.

    `pick_logits(logits [rows, V'], drafts so far [rows, i])` returns the distribution to pick from: processed
    logits, over the whole vocabulary or (processors that read the scores alone) over the draft vocabulary's
    columns; `None` for plain greedy drafting (the base, or corrected, logits themselves). Sampled drafts come back
    with their logits over the whole vocabulary.
    `keep_rolling(confidence [rows, j])`, asked before each draft after the first, may end the block early.
    `branches` n > 1: rows come in groups of n copies of one row, and the i-th of a group takes its i-th likeliest
    first draft (0: the likeliest), the head continuing from it: a tree's branches, one row each. Those first drafts
    are chosen, not drawn, also when sampling (`accept_rows` verifies them so, given `first`); the later ones are
    drawn as a block's.
    """
    config = drafter.config
    use_head = head and config.has_domino_head
    if not use_head and pick_logits is None and branches == 1:  # DFlash drafting, greedy: one argmax
        index = base_logits.argmax(dim=-1)
        return BatchDrafts(to_vocab_ids(index, vocab), None, picked_probability(base_logits, index))
    realised, chosen, confidence, state = anchor_ids, [], [], None
    for i in range(base_logits.shape[1]):
        if keep_rolling is not None and i and not keep_rolling(torch.stack(confidence, dim=-1)):
            break
        logits = base_logits[:, i]
        if use_head and i >= config.pure_draft_prefix_len:
            unread = realised[:, -(i + 1) :] if state is None else realised[:, -1:]
            weight = drafter.prefix_gru.weight_ih_l0
            state = drafter.gru_step(target.embed(unread, weight.dtype, weight.device), state)
            correction = drafter.logit_correction(hidden[:, i : i + 1], state, vocab)[:, 0]
            logits = logits + correction.to(device=logits.device, dtype=logits.dtype)
        if pick_logits is not None:
            logits = pick_logits(logits, realised[:, 1:])
        if i == 0 and branches > 1:  # row r of a group of n: its (r mod n)-th likeliest
            index = branch_columns(logits, branches)[:, None]
        else:
            index = pick_tokens(logits, do_sample)[:, None]
        on_columns = logits.shape[-1] != config.vocab_size  # over the draft vocabulary's columns
        token = to_vocab_ids(index, vocab) if on_columns else index
        confidence.append(picked_probability(logits, index[:, 0]))
        if do_sample:  # verified against the distribution each draft was drawn from, over the whole vocabulary
            chosen.append(spread_to_vocabulary(logits, vocab, config.vocab_size) if on_columns else logits)
        realised = torch.cat([realised, token.to(realised.device)], dim=-1)
    logits = torch.stack(chosen, dim=1) if do_sample else None
    return BatchDrafts(realised[:, 1:], logits, torch.stack(confidence, dim=-1))


# ---------------------------------------------------------------------------------------------- acceptance, per row
def along(values: torch.Tensor, path: torch.LongTensor) -> torch.Tensor:
    """`values[row, path[row]]`: `[rows, columns, X]` read along each row's columns `path` (`[rows, p]`)."""
    return values.gather(1, path[..., None].expand(-1, -1, values.shape[-1]))


def accept_rows(
    processed: torch.Tensor,
    candidates: torch.LongTensor,
    lengths: torch.LongTensor,
    draft_logits: torch.Tensor | None,
    do_sample: bool,
    copied: list[bool],
    first: torch.LongTensor | None = None,
) -> tuple[list[torch.LongTensor], list[int]]:
    """Per row: the tokens a verification adds (accepted drafts + the target's own) and how many drafts matched (read
    back once: everything after the verification counts on the host).

    Greedy: the longest prefix equal to the target's argmax. Sampling: transformers' `_speculative_sampling` on the
    row, with the exact processed logits each draft was drawn from, which keeps the target's distribution; a copied
    row's drafts with logits under which each is certain (`certain_logits`: the law of the target drawing at every
    position and the copies standing while they agree, for one draw).

    `first` (sampling, a tree's first drafts, which are chosen rather than drawn): each row's token at the first
    position, already drawn from `processed[:, 0]` (to find the branch that holds it). A row whose first draft is
    not that token adds it alone; one whose first draft is goes on with the rule above from the second draft: the
    first token is the target's own draw, and each later draft was drawn by the drafter after it, so the law is kept.
    """
    width = candidates.shape[1]
    if width == 0 and first is None:  # a plain step: each row's own token, nothing to read back
        picked = pick_tokens(processed[:, 0], do_sample)
        return list(picked[:, None]), [0] * len(picked)
    if not do_sample:
        selected = processed.argmax(dim=-1)
        offered = torch.arange(width, device=lengths.device)[None] < lengths[:, None]
        matches = ((candidates == selected[:, :width]) & offered).long().cumprod(dim=-1).sum(dim=-1).tolist()
        return [selected[row, : n + 1] for row, n in enumerate(matches)], matches
    tokens, matches = [], []
    for row, length in enumerate(lengths.tolist()):
        start = 0
        if first is not None:
            drawn = first[row : row + 1]
            if length == 0 or drawn[0] != candidates[row, 0]:
                tokens.append(drawn)
                matches.append(0)
                continue
            start = 1  # the first draft is the target's draw: the rest is verified as a block after it
        valid, n = _accept_row(
            processed[row, start : length + 1], candidates[row, start:length],
            None if draft_logits is None else draft_logits[row, start:length], copied[row],
        )  # fmt: skip
        tokens.append(valid if not start else torch.cat([first[row : row + 1], valid]))
        matches.append(start + n)
    return tokens, matches


def _accept_row(
    processed: torch.Tensor, drafts: torch.LongTensor, draft_logits: torch.Tensor | None, copied: bool
) -> tuple[torch.LongTensor, int]:
    """One sampled row: its tokens and accepted drafts, for `drafts` `[k]` and the target's `processed` `[k + 1, V]`."""
    length = drafts.shape[0]
    if length == 0:
        return pick_tokens(processed, do_sample=True), 0
    if copied:
        draft_logits = certain_logits(drafts, processed.shape[-1])
    valid, n = _speculative_sampling(drafts[None], draft_logits[None].to(processed.device), length, processed[None])
    return valid[0], int(n)


__all__ = [
    "BatchDrafts",
    "BatchedDrafterContext",
    "accept_rows",
    "along",
    "batched_rollout",
    "pick_tokens",
    "process_rows",
    "repeated_rows",
    "row_criteria",
    "row_processors",
    "run_batched_backbone",
]
