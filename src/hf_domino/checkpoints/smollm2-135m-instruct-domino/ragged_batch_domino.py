"""The pieces of a ragged batch: caches with holes, per-row positions and logits, the drafter over a whole batch.

Rows of a batch accept different numbers of drafts in a cycle. Both caches, the target's and the drafter's, stay
rectangular tensors with *holes*: a `RaggedCache` is a `DynamicCache` plus a mask of which of its columns are real
tokens of each row. A rejected draft's column becomes a hole (masked out of attention, skipped by the position count),
so no accepted token is ever recomputed and no row waits for another. Positions are per row: the number of real
columns before a token, exactly as transformers derives them from a left-padded attention mask. When holes waste
enough of the cache, it is compacted (each row's real columns gathered to the right). Also the verification's two
pieces: a target forward over such a cache (`ragged_forward`) and the acceptance rule per row (`accept_rows`).
`batching_domino` runs the loop that uses these pieces.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.utils import _speculative_sampling
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

from .cache_domino import CACHE_ARGUMENT, BufferedLayer, buffer_layers, cache_argument, uncached_prompt_length
from .drafting_domino import picked_probability, score_only, spread_to_vocabulary, to_vocab_ids
from .modeling_domino import TargetModules

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

    from .modeling_domino import DominoForSpeculation

# Compact a ragged cache once holes waste this share of its columns (and at least MIN_COMPACT_COLUMNS): a compaction
# copies the whole cache, holes only cost attention over masked columns.
COMPACT_FRACTION = 0.25
MIN_COMPACT_COLUMNS = 16


# ---------------------------------------------------------------------------------------------------- ragged caches
@dataclass
class RaggedCache:
    """A `DynamicCache` whose rows hold different numbers of real tokens: `mask[b, j]` says column j of row b is one.

    Left padding, rejected drafts and padding slots of shorter rows are holes (False). The position of a row's next
    token is its number of real columns.
    """

    cache: DynamicCache
    mask: torch.BoolTensor  # [rows, columns]
    last_width: int = 0  # columns the latest forward appended
    window: SlidingWindow | None = None  # the target's sliding-window attention, if it has any

    @staticmethod
    def check(cache: Any, who: str) -> None:
        """Raises unless every layer is a plain dynamic layer (holes need full-length, croppable keys/values)."""
        plain = (DynamicLayer, BufferedLayer)
        if not isinstance(cache, DynamicCache):
            what = type(cache).__name__
        else:
            what = next((type(layer).__name__ for layer in cache.layers if type(layer) not in plain), None)
            what = what and f"a DynamicCache with {what} layers"
        if what is not None:
            raise ValueError(
                f"Batched Domino drafting keeps holes in the {who}'s cache, which needs a DynamicCache of "
                f"full-attention (or sliding-window) layers; got {what}. Drop cache_implementation and "
                f"{CACHE_ARGUMENT}, or generate one prompt at a time."
            )

    @property
    def lengths(self) -> torch.LongTensor:
        """Real tokens per row: the position of each row's next token."""
        return self.mask.sum(dim=-1)

    def attention_mask(self, new_columns: torch.BoolTensor) -> torch.BoolTensor:
        """The mask over `[cache ; new_columns]` for a forward that appends `new_columns` (`[rows, q]`)."""
        return torch.cat([self.mask, new_columns], dim=-1)

    def appended(self, new_columns: torch.BoolTensor) -> None:
        """Records that a forward appended these columns to the cache."""
        self.mask, self.last_width = self.attention_mask(new_columns), new_columns.shape[1]

    def keep_appended(self, keep: torch.LongTensor) -> None:
        """Of the columns appended last, row b keeps its first `keep[b]`: the rest become holes."""
        first_new = self.mask.shape[1] - self.last_width
        columns = torch.arange(self.mask.shape[1], device=self.mask.device)
        self.mask &= columns[None] < first_new + keep.to(self.mask.device)[:, None]
        self._crop_trailing_holes()

    def keep_columns(self, keep: torch.BoolTensor) -> None:
        """Of the columns appended last, row b keeps those where `keep[b]` (`[rows, last_width]`) is True: a tree's
        accepted branch, whose columns need not be the first ones. The rest become holes."""
        first_new = self.mask.shape[1] - self.last_width
        self.mask[:, first_new:] &= keep.to(self.mask.device)
        self._crop_trailing_holes()

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keeps only these rows (finished rows leave the batch)."""
        self.cache.batch_select_indices(rows.to(self.mask.device))
        self.mask = self.mask[rows.to(self.mask.device)]
        self._crop_trailing_holes()

    def _crop_trailing_holes(self) -> None:
        real = self.mask.any(dim=0).nonzero()
        trailing = self.mask.shape[1] - (int(real[-1]) + 1 if real.numel() else 0)
        if trailing:
            self.cache.crop(-trailing)
            self.mask = self.mask[:, : self.mask.shape[1] - trailing]

    def maybe_compact(self) -> bool:
        """Gathers each row's real columns to the right once holes waste enough columns of every row.

        Keys already carry their rotary positions, so moving a column changes nothing but where it is stored.
        """
        width = self.mask.shape[1]
        needed = int(self.lengths.max()) if width else 0
        if width - needed < max(MIN_COMPACT_COLUMNS, COMPACT_FRACTION * width):
            return False
        # A stable sort puts each row's holes first and its real columns after them, in order.
        order = torch.sort(self.mask.to(torch.int8), dim=-1, stable=True).indices[:, width - needed :]
        self.mask = torch.gather(self.mask, 1, order)
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                index = order.to(layer.keys.device)[:, None, :, None]
                layer.keys = torch.gather(
                    layer.keys, 2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                )
                layer.values = torch.gather(
                    layer.values, 2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[3])
                )
        return True


def positions_from_mask(mask: torch.BoolTensor, first: torch.LongTensor | int = 0) -> torch.LongTensor:
    """Position of each column: real columns before it (plus `first`); holes get 1, as transformers does for pads."""
    positions = mask.long().cumsum(dim=-1) - 1 + (first[:, None] if torch.is_tensor(first) else first)
    return positions.masked_fill(~mask, 1)


def cached_columns(
    cache: DynamicCache | None,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    generation_config: GenerationConfig,
) -> int:
    """How many of the batch's prompt columns a cache passed to generate() already holds (0: a fresh cache). A batch
    continues a filled cache as the target alone does when input_ids are the whole sequences (the cached columns, then
    the new ones) with their attention mask; new tokens alone are refused, since the rows' padding is in the mask."""
    cached = cache.get_seq_length() if cache is not None else 0
    if not cached:
        return 0
    uncached = uncached_prompt_length(cache, input_ids, attention_mask, generation_config)
    if uncached is None:
        raise ValueError(
            f"The cache passed to generate() holds {cached} columns, and input_ids ({input_ids.shape[1]} columns) are "
            "not the whole sequences the attention mask covers: a batch continuing a cache needs the whole padded "
            "sequences, the cached columns included, with an attention mask of the same length."
        )
    rows = next((layer.keys.shape[0] for layer in cache.layers if layer.is_initialized), input_ids.shape[0])
    if rows != input_ids.shape[0]:
        raise ValueError(
            f"The cache passed to generate() holds {rows} rows and the batch has {input_ids.shape[0]}: continue a "
            "cache with the same rows it was filled with (num_return_sequences > 1 repeats the rows, not the cache)."
        )
    return input_ids.shape[1] - uncached


def batch_cache(cache: Any, target: PreTrainedModel) -> tuple[DynamicCache, SlidingWindow | None]:
    """The target's cache a batch starts from, and its sliding window if it has one (`SlidingWindow.take_over`).

    The holes need a dynamic cache: an empty compileable one (what generate() makes for
    `cache_implementation="static"` where it does not compile the forward; where it does, the batch takes compiled
    plain steps instead) is swapped for a `DynamicCache`, with a warning, the output being the same; any other cache
    but a dynamic one of full-attention and sliding-window layers is refused (`RaggedCache.check`)."""
    if (
        cache is not None
        and type(cache) is not DynamicCache
        and getattr(cache, "is_compileable", False)
        and not int(cache.get_seq_length())
    ):
        warnings.warn(
            f"A batch drafted with a Domino drafter keeps holes in a dynamic cache: the empty {type(cache).__name__} "
            "generate() was given or made (cache_implementation) is not used; the output is the same. One sequence "
            "at a time verifies on the static cache.",
            stacklevel=3,
        )
        cache = DynamicCache(config=target.config)
    window = SlidingWindow.take_over(cache, target) if isinstance(cache, DynamicCache) else None
    RaggedCache.check(cache, "target")
    return cache, window


@dataclass(frozen=True)
class SlidingWindow:
    """A target's sliding-window attention over a ragged cache: a token sees the `size` tokens up to itself.

    transformers counts a window in cache columns, which in a left-padded batch are each row's tokens. Holes break
    that (a row's rejected drafts take columns but are no tokens), so over a ragged cache the window is counted in
    each row's own positions, in 4D masks built here (`masks`), and the sliding layers keep every column for the call
    (a sliding layer keeps only its last `size - 1` columns, which holes would make fewer tokens than the window).
    """

    size: int
    every_layer: bool  # all layers slide (one mask for all); else a dict of masks by layer type, as hybrids take
    additive: bool  # the attention implementation adds its mask (eager) rather than selecting by it (sdpa)

    @classmethod
    def take_over(cls, cache: DynamicCache, target: PreTrainedModel) -> SlidingWindow | None:
        """Makes the sliding layers of `cache` plain dynamic layers and returns their window (None: none slides).

        Raises where the window cannot be kept exactly: a filled sliding layer that already dropped tokens, layers of
        different windows, layer types other than full and sliding attention, or an attention implementation that
        takes no prepared 4D mask (flash attention, flex attention)."""
        slides = [layer for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
        if not slides:
            return None
        windows = {layer.sliding_window for layer in slides}
        layer_types = set(getattr(target.config.get_text_config(), "layer_types", None) or ())
        additive = adds_its_mask(target)
        problem = None
        if len(windows) > 1:
            problem = f"its sliding layers have different windows ({sorted(windows)})"
        elif not layer_types <= {"full_attention", "sliding_attention"}:
            problem = f"it has attention layers of types {sorted(layer_types)}, only full and sliding are supported"
        elif additive is None:
            problem = takes_no_4d_mask(target)
        elif any(layer.is_initialized and layer.keys.shape[-2] < layer.cumulative_length for layer in slides):
            problem = (
                "the cache passed to generate() has sliding-window layers that already dropped tokens past their "
                "window; start the batch from its prompts (no cache)"
            )
        if problem is not None:
            raise ValueError(
                f"Batched Domino drafting counts sliding windows in each row's own tokens, which this target's cache "
                f"cannot serve: {problem}. Or generate one prompt at a time."
            )
        cache.layers = [
            _full_layer(layer) if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in cache.layers
        ]
        every_layer = len(slides) == len(cache.layers)
        return cls(size=windows.pop(), every_layer=every_layer, additive=additive)

    def masks(
        self, real: torch.BoolTensor, queries: int, dtype: torch.dtype
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The attention masks of a forward whose last `queries` columns of `real` (`[rows, columns]`, True for a
        row's tokens, False for holes) are its queries: causal over columns, holes masked, and for sliding layers
        only keys fewer than `size` positions before the query (positions: each row's count of its tokens)."""
        columns = torch.arange(real.shape[1], device=real.device)
        causal = columns[None, :] <= columns[-queries:, None]  # [queries, columns]
        full = real[:, None, :] & causal[None]
        positions = real.long().cumsum(dim=-1)
        near = positions[:, -queries:, None] - positions[:, None, :] < self.size
        sliding = (full & near)[:, None]
        if self.every_layer:
            return self._formatted(sliding, dtype)
        return {
            "full_attention": self._formatted(full[:, None], dtype),
            "sliding_attention": self._formatted(sliding, dtype),
        }

    def _formatted(self, mask: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
        return formatted_mask(mask, self.additive, dtype)


def adds_its_mask(target: PreTrainedModel) -> bool | None:
    """How the target's attention takes a prepared 4D mask: added (eager, True), selected by (sdpa, False), or not at
    all (None: flash and flex attention build their own)."""
    mask_function = ALL_MASK_ATTENTION_FUNCTIONS.get(target.config._attn_implementation)
    return {sdpa_mask: False, eager_mask: True}.get(mask_function)


def takes_no_4d_mask(target: PreTrainedModel) -> str:
    """Why a target whose attention builds its own mask (`adds_its_mask` is None) cannot serve holes or trees, and the
    fix."""
    return (
        f"its attention implementation {target.config._attn_implementation!r} takes no prepared 4D mask; load the "
        'target with attn_implementation="sdpa" (or "eager")'
    )


def formatted_mask(mask: torch.BoolTensor, additive: bool, dtype: torch.dtype) -> torch.Tensor:
    """A boolean 4D mask as the attention takes it: as is (sdpa), or 0 / the dtype's minimum (eager)."""
    if not additive:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _full_layer(layer: DynamicSlidingWindowLayer) -> DynamicLayer:
    full = DynamicLayer()
    if layer.is_initialized:
        full.lazy_initialization(layer.keys, layer.values)
        full.keys, full.values = layer.keys, layer.values
    return full


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

    def append(self, features: torch.Tensor, counts: torch.LongTensor) -> None:
        """Row b's next `counts[b]` verified tokens have target features `features[b, :counts[b]]`."""
        features = features.to(self.known.device)
        for row, count in enumerate(counts.tolist()):
            self.pending[row].append(features[row, :count])
        self.known += counts.to(self.known.device)

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
    hidden = drafter(
        drafter.embed_block(target, anchor_ids),
        features,
        torch.cat([pending_positions, block_positions], dim=-1),
        attention_mask=additive,
        past_key_values=context.cache.cache,
        num_outputs=drafter.outputs_for_drafts(num_drafts),
    )
    context.cache.appended(pending_mask)  # the forward already dropped the block's own keys/values
    context.cache.maybe_compact()
    context.pending = [[] for _ in context.pending]
    return drafter.draft_hidden_states(hidden)[:, :num_drafts]


# ------------------------------------------------------------------------------------------------ logits, per row
def row_processors(logits_processor: LogitsProcessorList, rows: int) -> list[LogitsProcessorList]:
    """The call's logits processors as each row of the batch sees them, to be called with that row alone.

    Processors are shared, except those that tell the rows apart: the repetition penalty's `prompt_ignore_length`
    (one entry per row, its left padding) and `prefix_allowed_tokens_fn` (called with the row's index in the batch,
    which a row processed alone would read as 0) get a copy per row that answers for that row.
    """
    views = []
    for row in range(rows):
        view = LogitsProcessorList()
        for processor in logits_processor:
            if isinstance(processor, RepetitionPenaltyLogitsProcessor) and torch.is_tensor(
                processor.prompt_ignore_length
            ):
                processor = copy.copy(processor)
                processor.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
            elif isinstance(processor, PrefixConstrainedLogitsProcessor):
                processor = PrefixConstrainedLogitsProcessor(_for_row(processor._prefix_allowed_tokens_fn, row), 1)
            view.append(processor)
        views.append(view)
    return views


def _for_row(prefix_allowed_tokens_fn, row: int):
    """`prefix_allowed_tokens_fn` as the batch's row `row` calls it (generate() drafts with one beam per row)."""
    return lambda batch_id, sentence: prefix_allowed_tokens_fn(row, sentence)


def process_rows(
    processors: list[LogitsProcessorList] | None,
    sequences: list[torch.LongTensor],
    logits: torch.Tensor,
    extra: torch.LongTensor | None = None,
) -> torch.Tensor:
    """Applies each row's logits processors to its row of `logits [rows, V]`, row b seeing `sequences[b] + extra[b]`.

    Each row sees exactly the input_ids the target alone would pass for it (its left-padded prompt and its tokens
    so far), so penalties and minimum lengths act per row as they would without a drafter.
    """
    if not processors or not len(processors[0]):
        return logits
    if score_only(processors[0]):
        return processors[0](sequences[0][None], logits)  # they read the scores only: all rows at once
    rows = []
    for row, sequence in enumerate(sequences):
        ids = sequence if extra is None else torch.cat([sequence, extra[row].to(sequence.device)])
        rows.append(processors[row](ids[None], logits[row : row + 1]))
    return torch.cat(rows)


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
        """One of a tree's branches (greedy: no logits), as a block of every row."""
        return BatchDrafts(self.ids[:, index], None, self.confidence[:, index])


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
    `branches` n > 1 (greedy): rows come in groups of n copies of one row, and the i-th of a group takes its i-th
    likeliest first draft (0: the likeliest), the head continuing from it: a tree's branches, one row each.
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
        if i == 0 and branches > 1:  # row r of a group of n: its (r mod n)-th likeliest, no device round trip
            likeliest = logits.topk(branches, dim=-1).indices.view(-1, branches, branches)
            index = likeliest.diagonal(dim1=1, dim2=2).reshape(-1, 1)
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


# ------------------------------------------------------------------------------------------ verification, per row
@dataclass(frozen=True)
class TreeLayout:
    """`branches` branches of `drafts` drafts after each row's anchor, verified in one forward.

    Columns: the anchor, then branch 0's drafts, branch 1's, ... A draft sees the cache, the anchor and the earlier
    drafts of its own branch; draft j of every branch sits at the anchor's position + 1 + j. `additive` says how the
    target's attention takes the 4D mask this needs (`adds_its_mask`).
    """

    branches: int
    drafts: int
    additive: bool

    @property
    def width(self) -> int:
        return 1 + self.branches * self.drafts

    def _branch_and_depth(self, device: torch.device) -> tuple[torch.LongTensor, torch.LongTensor]:
        branch = torch.arange(self.branches, device=device).repeat_interleave(self.drafts)
        depth = (1 + torch.arange(self.drafts, device=device)).repeat(self.branches)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return torch.cat([zero - 1, branch]), torch.cat([zero, depth])

    def visibility(self, device: torch.device) -> torch.BoolTensor:
        """`[width, width]`: which of the forward's columns each of them attends to."""
        branch, depth = self._branch_and_depth(device)
        own_branch = (branch[:, None] == branch[None, :]) & (depth[None, :] <= depth[:, None])
        return own_branch | (branch[None, :] == -1)

    def offsets(self, device: torch.device) -> torch.LongTensor:
        """`[width]`: each column's position after the anchor's."""
        return self._branch_and_depth(device)[1]

    def path(self, branch: torch.LongTensor) -> torch.LongTensor:
        """`[rows, 1 + drafts]`: the columns of the anchor and of each row's branch `branch[row]`."""
        drafts = torch.arange(self.drafts, device=branch.device)
        columns = 1 + branch[:, None] * self.drafts + drafts[None]
        return torch.cat([torch.zeros_like(branch)[:, None], columns], dim=-1)


def ragged_forward(
    target: PreTrainedModel,
    cache: RaggedCache,
    input_ids: torch.LongTensor,
    new_columns: torch.BoolTensor,
    hidden_layers: list[int],
    logits_to_keep: int | None = None,
    tree: TreeLayout | None = None,
):
    """One target forward that appends `input_ids` to every row; holes among them are `new_columns == False`.

    With `tree`, the new columns are a `TreeLayout` of branches after each row's anchor, not one sequence."""
    kwargs = {}
    # Asked only when needed (the prefill): reading a signature costs more than the rest of a step's host work.
    if logits_to_keep is not None and "logits_to_keep" in inspect.signature(target.forward).parameters:
        kwargs["logits_to_keep"] = logits_to_keep
    attention_mask = cache.attention_mask(new_columns)
    positions = positions_from_mask(new_columns, cache.lengths)
    if tree is not None:
        queries, device = new_columns.shape[1], new_columns.device
        visible = attention_mask[:, None, :].repeat(1, queries, 1)
        visible[:, :, -queries:] &= tree.visibility(device)[None]
        attention_mask = formatted_mask(visible[:, None], tree.additive, target.dtype)
        positions = cache.lengths[:, None] + tree.offsets(device)[None]
    elif cache.window is None:
        attention_mask = attention_mask.long()
    else:
        attention_mask = cache.window.masks(attention_mask, new_columns.shape[1], target.dtype)
    outputs = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        **cache_argument(cache.cache),
        output_hidden_states=hidden_layers,
        **kwargs,
    )
    cache.appended(new_columns)
    return outputs


def accept_rows(
    processed: torch.Tensor,
    candidates: torch.LongTensor,
    lengths: torch.LongTensor,
    draft_logits: torch.Tensor | None,
    do_sample: bool,
    copied: list[bool],
) -> tuple[list[torch.LongTensor], torch.LongTensor]:
    """Per row: the tokens a verification adds (accepted drafts + the target's own) and how many drafts matched.

    Greedy: the longest prefix equal to the target's argmax. Sampling: transformers' `_speculative_sampling` on the
    row, with the exact processed logits each draft was drawn from, which keeps the target's distribution. Copied
    rows have no draft distribution: the target draws at every position and the copies stand while they agree with
    its draws (transformers' rule for such drafts), which is exact too.
    """
    width = candidates.shape[1]
    if not do_sample:
        selected = processed.argmax(dim=-1)
        offered = torch.arange(width, device=lengths.device)[None] < lengths[:, None]
        matches = ((candidates == selected[:, :width]) & offered).long().cumprod(dim=-1).sum(dim=-1)
        return [selected[row, : n + 1] for row, n in enumerate(matches.tolist())], matches
    tokens, matches = [], []
    for row, length in enumerate(lengths.tolist()):
        if length == 0 or copied[row]:
            drawn = pick_tokens(processed[row, : length + 1], do_sample=True)
            n = int((drawn[:length] == candidates[row, :length]).long().cumprod(dim=-1).sum())
            tokens.append(drawn[: n + 1])
            matches.append(n)
            continue
        valid, n = _speculative_sampling(
            candidates[row : row + 1, :length],
            draft_logits[row : row + 1, :length].to(processed.device),
            length,
            processed[row : row + 1, : length + 1],
        )
        tokens.append(valid[0])
        matches.append(int(n))
    return tokens, torch.tensor(matches, device=lengths.device)


__all__ = [
    "BatchDrafts",
    "BatchedDrafterContext",
    "RaggedCache",
    "SlidingWindow",
    "TreeLayout",
    "accept_rows",
    "batched_rollout",
    "pick_tokens",
    "positions_from_mask",
    "process_rows",
    "ragged_forward",
    "row_processors",
    "run_batched_backbone",
]
