"""Caches with holes: the target's cache of a ragged batch, its masks and positions, and one forward over it.

Rows of a batch accept different numbers of drafts in a cycle. Both caches, the target's and the drafter's, stay
rectangular tensors with *holes*: a `RaggedCache` is a `DynamicCache` plus a mask of which of its columns are real
tokens of each row. A rejected draft's column becomes a hole (masked out of attention, skipped by the position count),
so no accepted token is ever recomputed and no row waits for another. Positions are per row: the number of real
columns before a token, exactly as transformers derives them from a left-padded attention mask. When holes waste
enough of the cache, it is compacted (each row's real columns gathered to the right). Here too: the cache a batch
starts from (`batch_cache`, `cached_columns`), a tree of branches after each row's anchor (`TreeLayout`), and the
target forward over such a cache (`ragged_forward`), whose sliding windows and column positions `ragged_masks_domino`
counts. `ragged_batch_domino` has the drafter's side and the acceptance rule; `batching_domino` runs the loop.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from .cache_domino import (
    CACHE_ARGUMENT,
    BufferedLayer,
    cache_argument,
    cached_tokens,
    set_states,
    uncached_prompt_length,
)
from .ragged_masks_domino import QueryTemperature, SlidingWindow, formatted_mask, with_gaps
from .recurrent_cache_domino import (
    RecurrentRollback,
    add_state_rows,
    layer_for_rows,
    put_row_states,
    row_states,
    select_state_rows,
)

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel


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
    # The linear-attention and state-space layers of a target with a replayable scan (Qwen3.5, Nemotron-H, ...): no
    # columns, one state per row, kept to what each row accepted (`RecurrentRollback.keep_rows`).
    recurrent: RecurrentRollback | None = None
    # Per row, the columns its prompt's mask leaves out (left padding, padding inside), counted before each of its
    # tokens (`prompt_gaps`): no tokens, but columns, which the target alone counts in a sliding window, and in its
    # positions where it places tokens by column (`by_column`, `places_by_column`). None where neither applies.
    gaps: torch.LongTensor | None = None
    by_column: bool = False
    # Llama 4's query temperature, which the target alone takes from its count of columns (`QueryTemperature`).
    temperature: QueryTemperature | None = None

    @staticmethod
    def check(cache: Any, who: str) -> None:
        """Raises unless every layer is a plain dynamic layer (holes need full-length, croppable keys/values), one
        with the indexer keys of sparse attention beside them (DeepSeek-V3.2's, GLM-5's: a column per token too), a
        linear-attention layer (a recurrent state per row, see `recurrent`), both (Falcon-H1's), or none (a layer
        without a cache, such as Nemotron-H's MLP layers): `JOINABLE`."""
        if not isinstance(cache, DynamicCache):
            what = type(cache).__name__
        else:
            what = next((type(layer).__name__ for layer in cache.layers if type(layer) not in JOINABLE), None)
            what = what and f"a DynamicCache with {what} layers"
        if what is not None:
            raise ValueError(
                f"Batched Domino drafting keeps holes in the {who}'s cache, which needs a DynamicCache of "
                f"full-attention (or sliding-window) layers; got {what}. Drop cache_implementation and "
                f"{CACHE_ARGUMENT}, or generate one prompt at a time."
            )

    @property
    def counts_columns(self) -> bool:
        """Whether the target reads a token's column in the cache, holes and left padding included: where it places
        tokens by column, or scales queries by the count of columns."""
        return self.by_column or self.temperature is not None

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

    @property
    def attention_layers(self) -> list[DynamicLayer]:
        """The layers holding keys and values: their columns are the mask's. A layer that also keeps a recurrent
        state (Falcon-H1's) has its columns handled here through `DynamicLayer`'s methods, its state by `recurrent`."""
        return [layer for layer in self.cache.layers if isinstance(layer, DynamicLayer)]

    def before_forward(self, width: int) -> None:
        """Called before a forward appends `width` columns per row."""
        if self.recurrent is not None:
            self.recurrent.before_rows_forward(width)

    def keep_appended(self, keep: list[int]) -> None:
        """Of the columns appended last, row b keeps its first `keep[b]` (at least one, all of them real): the rest
        become holes."""
        first_new = self.mask.shape[1] - self.last_width
        columns = torch.arange(self.mask.shape[1], device=self.mask.device)
        kept = torch.tensor(keep)  # on the host: the recurrent states read it back as a list
        self.mask &= columns[None] < first_new + kept.to(self.mask.device)[:, None]
        if self.recurrent is not None:
            self.recurrent.keep_rows(kept)
        # The longest row's last kept column is real: what follows it is holes in every row, known on the host.
        self._crop_trailing(self.last_width - max(keep, default=self.last_width))

    def keep_columns(self, keep: torch.BoolTensor) -> None:
        """Of the columns appended last, row b keeps those where `keep[b]` (`[rows, last_width]`) is True: a tree's
        accepted branch, whose columns need not be the first ones. The rest become holes."""
        first_new = self.mask.shape[1] - self.last_width
        self.mask[:, first_new:] &= keep.to(self.mask.device)
        self._crop_trailing_holes()

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keeps only these rows (finished rows leave the batch)."""
        rows = rows.to(self.mask.device)
        for layer in self.attention_layers:
            columns_of(layer).batch_select_indices(layer, rows)
        for layer in self.cache.layers:
            select_state_rows(layer, rows)
        self.mask = self.mask[rows]
        if self.gaps is not None:
            self.gaps = self.gaps[rows.to(self.gaps.device)]
        self._crop_trailing_holes()

    def _crop_trailing_holes(self) -> None:
        real = self.mask.any(dim=0).nonzero()
        self._crop_trailing(self.mask.shape[1] - (int(real[-1]) + 1 if real.numel() else 0))

    def _crop_trailing(self, trailing: int) -> None:
        """Drops the last `trailing` columns, holes in every row."""
        if trailing:
            for layer in self.attention_layers:
                columns_of(layer).crop(layer, -trailing)
            self.mask = self.mask[:, : self.mask.shape[1] - trailing]

    def add_rows(self, other: RaggedCache) -> None:
        """Appends the rows of `other`, a cache of the same model filled apart (a request a server admits), after
        this cache's. The side with fewer columns gets holes on the left: both go on appending at the right. A layer
        one side has not filled yet (the drafter's cache of a row that has not drafted) joins as holes. Recurrent
        states join by rows (`add_state_rows`); the forward after the join verifies (`RecurrentRollback.started`)."""
        rows, width = (self.mask.shape[0], other.mask.shape[0]), max(self.mask.shape[1], other.mask.shape[1])
        for index in range(max(len(self.cache.layers), len(other.cache.layers))):
            sides = [cache.cache.layers[index] if index < len(cache.cache.layers) else None for cache in (self, other)]
            if sides[0] is not None and sides[1] is not None:
                add_state_rows(sides[0], sides[1])
            states = _joined_states(sides, rows, width)
            if not states:
                continue
            if sides[0] is None:
                sides[0] = self.cache.layer_class_to_replicate()
                self.cache.layers.append(sides[0])
            put_states(sides[0], states)
        self.mask = torch.cat(
            [torch.nn.functional.pad(mask.to(self.mask.device), (width - mask.shape[1], 0)) for mask in
             (self.mask, other.mask)]
        )  # fmt: skip
        self.gaps = joined_gaps([self, other])
        if self.recurrent is not None:
            self.recurrent.started = True

    def maybe_compact(self) -> bool:
        """Gathers each row's real columns to the right once holes waste enough columns of every row.

        Keys already carry their rotary positions, so moving a column changes nothing but where it is stored.
        """
        width = self.mask.shape[1]
        needed = int(self.lengths.max()) if width else 0
        if width - needed < max(MIN_COMPACT_COLUMNS, COMPACT_FRACTION * width):
            return False
        self._compact(width, needed)
        return True

    def copied_rows(self, rows: list[int], tokens: list[int]) -> RaggedCache:
        """A cache of its own holding copies of these rows, row i cut to its first `tokens[i]` real columns: what a
        finished row leaves for the cache a call returns. A recurrent state is copied as it is: it holds exactly the
        row's tokens but its last (`BatchedDecoding.verify` keeps no column past a row's end in such a cache)."""
        index = torch.tensor(rows, device=self.mask.device)
        cache = _cache_of([
            layer_holding(layer, {
                name: state.index_select(COLUMN_STATES[name][0], index.to(state.device))
                for name, state in column_states(layer).items()
            }, {key: state.index_select(0, index.to(state.device)) for key, state in row_states(layer).items()})
            for layer in self.cache.layers
        ])  # fmt: skip
        mask = self.mask[index]
        mask &= mask.cumsum(dim=-1) <= torch.tensor(tokens, device=mask.device)[:, None]
        gaps = None if self.gaps is None else self.gaps[index.to(self.gaps.device)]
        copied = self.holding(cache, mask, gaps)
        copied._crop_trailing_holes()
        return copied

    def holding(self, cache: DynamicCache, mask: torch.BoolTensor, gaps: torch.LongTensor | None) -> RaggedCache:
        """Another ragged cache of the same target: its sliding window and how it counts columns, with these rows."""
        return RaggedCache(
            cache, mask, window=self.window, gaps=gaps, by_column=self.by_column, temperature=self.temperature
        )

    @classmethod
    def stacked(cls, pieces: list[RaggedCache]) -> RaggedCache:
        """The rows of `pieces` (copies of the same cache's rows, `copied_rows`) in one cache, in order, each widened
        by holes on the left to the widest: one copy, where joining them one by one (`add_rows`) copies every time."""
        width, rows = max(piece.mask.shape[1] for piece in pieces), [piece.mask.shape[0] for piece in pieces]
        cache = _cache_of([
            layer_holding(layers[0], _joined_states(layers, rows, width), _joined_row_states(layers))
            for layers in zip(*(piece.cache.layers for piece in pieces))
        ])  # fmt: skip
        mask = torch.cat([torch.nn.functional.pad(piece.mask, (width - piece.mask.shape[1], 0)) for piece in pieces])
        return pieces[0].holding(cache, mask, joined_gaps(pieces))

    def arrange(self, layout: torch.BoolTensor) -> None:
        """Moves each row's real columns, in order, to where `layout` (`[rows, columns]`) is True, zeros elsewhere:
        the columns of the attention mask a caller continues the cache with, as the target alone's cache has them."""
        if not torch.equal(self.lengths, layout.sum(dim=-1)):
            raise RuntimeError(f"Rows of {self.lengths.tolist()} tokens cannot fill {layout.sum(dim=-1).tolist()}.")
        real_first = torch.sort((~self.mask).to(torch.int8), dim=-1, stable=True).indices
        source = torch.gather(real_first, 1, (layout.long().cumsum(dim=-1) - 1).clamp(min=0))
        for layer in self.attention_layers:
            _move_columns(layer, source, keep=layout)
        self.mask = layout

    def _compact(self, width: int, needed: int) -> None:
        # A stable sort puts each row's holes first and its real columns after them, in order.
        order = torch.sort(self.mask.to(torch.int8), dim=-1, stable=True).indices[:, width - needed :]
        self.mask = torch.gather(self.mask, 1, order)
        for layer in self.attention_layers:
            _move_columns(layer, order)


# The cache layers a batch holds, whose rows are copied, joined and dropped: by their columns, keys and values of full
# attention (sliding layers are made full ones for a batch, `SlidingWindow.take_over`) with the indexer's keys of
# sparse attention beside them; by their rows, a linear-attention layer's recurrent states (`row_states`), with keys
# and values beside them (Falcon-H1's); or none (a layer reading another layer's, Gemma 4's).
JOINABLE = (
    DynamicLayer,
    BufferedLayer,
    DynamicIndexedLayer,
    DummyLayer,
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
)
# The tensors of a cache layer with a column per token, by name: the dimensions of their rows and of their columns.
# A sparse-attention layer (DeepSeek-V3.2's, GLM-5's) keeps its indexer's keys beside its own, some its positions too.
COLUMN_STATES = {"keys": (0, 2), "values": (0, 2), "indexer_keys": (0, 1), "indexer_position_ids": (1, 2)}


def _holds_keys(layer: Any) -> bool:
    """Whether a cache layer holds keys and values of its own: filled, and not a `DummyLayer` (whose layer reads
    another layer's, or keeps none)."""
    return isinstance(layer, DynamicLayer) and layer.is_initialized


def column_states(layer: Any) -> dict[str, torch.Tensor]:
    """The tensors `layer` holds with a column per token (`COLUMN_STATES`), by name; none where it holds no keys."""
    if not _holds_keys(layer):
        return {}
    return {name: getattr(layer, name) for name in COLUMN_STATES if getattr(layer, name, None) is not None}


def put_states(layer: DynamicLayer, states: dict[str, torch.Tensor]) -> DynamicLayer:
    """`layer` holding these tensors (`column_states`' kind) in place of its own; returns it."""
    if "keys" in states:
        set_states(layer, states["keys"], states["values"])
    if "indexer_keys" in states:
        if not layer.is_indexer_initialized:
            layer.lazy_initialization_indexer(states["indexer_keys"])
        layer.indexer_keys = states["indexer_keys"]
    if "indexer_position_ids" in states:
        layer.indexer_position_ids = states["indexer_position_ids"]
    return layer


def layer_holding(
    like: Any, states: dict[str, torch.Tensor], per_row: dict[tuple[str, int], torch.Tensor] | None = None
) -> Any:
    """A new layer of `like`'s kind (full attention, sparse attention, linear attention with or without attention
    beside it, none of its own) holding the column tensors `states` and the recurrent layer's states `per_row`."""
    if isinstance(like, DummyLayer):
        return DummyLayer()
    if isinstance(like, LinearAttentionCacheLayerMixin):
        layer = layer_for_rows(like)
        put_row_states(layer, per_row or {})
        return put_states(layer, states)
    return put_states(DynamicIndexedLayer() if isinstance(like, DynamicIndexedLayer) else DynamicLayer(), states)


def _joined_states(layers: list[Any], rows: list[int], width: int) -> dict[str, torch.Tensor]:
    """The column tensors of `layers`' rows (`rows[i]` each; a layer None or not filled gives holes) in one, each
    widened by holes on the left to `width` columns; none where no layer is filled."""
    states = [column_states(layer) for layer in layers]  # {} for a layer None or not filled
    template = next((held for held in states if held), {})
    joined = {}
    for name, like in template.items():
        row_dim, column_dim = COLUMN_STATES[name]
        pieces = [_left_holes(held.get(name), like, row_dim, column_dim, n, width) for held, n in zip(states, rows)]
        joined[name] = torch.cat(pieces, dim=row_dim)
    return joined


def _joined_row_states(layers: list[Any]) -> dict[tuple[str, int], torch.Tensor]:
    """The per-row states (`row_states`) of `layers`' rows in one: no columns to widen."""
    held = [row_states(layer) for layer in layers]
    return {key: torch.cat([states[key] for states in held]) for key in held[0]}


def _move_columns(layer: DynamicLayer, order: torch.LongTensor, keep: torch.BoolTensor | None = None) -> None:
    """Puts each row's columns of `layer` in `order` (`[rows, columns]`), zeros where `keep` (the same shape) is
    False."""
    moved = {}
    for name, state in column_states(layer).items():
        if state.numel():
            row_dim, column_dim = COLUMN_STATES[name]
            state = gather_columns(state, order.to(state.device), row_dim, column_dim)
            if keep is not None:
                shape = [1] * state.dim()
                shape[row_dim], shape[column_dim] = keep.shape
                state = state.where(keep.view(shape).to(state.device), 0)
            moved[name] = state
    put_states(layer, moved)


def _cache_of(layers: list[DynamicLayer]) -> DynamicCache:
    """A `DynamicCache` holding these layers (copies of rows, made here, not by a model)."""
    cache = DynamicCache()
    cache.layers = layers
    return cache


def _left_holes(
    state: torch.Tensor | None, template: torch.Tensor, row_dim: int, column_dim: int, rows: int, width: int
) -> torch.Tensor:
    """A layer's column tensor (keys, values, ...) widened to `width` columns by holes on the left; zeros shaped as
    `template` for a layer not filled yet."""
    if state is None or state.numel() == 0:
        shape = list(template.shape)
        shape[row_dim], shape[column_dim] = rows, width
        return template.new_zeros(shape)
    after = state.dim() - 1 - column_dim  # pad's pairs count from the last dimension
    return torch.nn.functional.pad(state, (0, 0) * after + (width - state.shape[column_dim], 0))


def gather_columns(tensor: torch.Tensor, order: torch.LongTensor, row_dim: int, column_dim: int) -> torch.Tensor:
    """`tensor`'s columns along `column_dim` in each row's `order` (`[rows, columns kept]`; rows along `row_dim`)."""
    shape, size = [1] * tensor.dim(), list(tensor.shape)
    shape[row_dim], shape[column_dim] = order.shape
    size[column_dim] = order.shape[1]
    return torch.gather(tensor, column_dim, order.to(tensor.device).reshape(shape).expand(size))


def columns_of(layer: DynamicLayer) -> type[DynamicLayer]:
    """The class whose `crop` and `batch_select_indices` handle every tensor of `layer` with a column per token: its
    own for a sparse-attention layer (keys and values, and the indexer's keys), `DynamicLayer`'s for one that also
    holds a recurrent state (Falcon-H1's), which `RecurrentRollback` keeps per row."""
    return type(layer) if isinstance(layer, DynamicIndexedLayer) else DynamicLayer


def joined_gaps(caches: list[RaggedCache]) -> torch.LongTensor | None:
    """The `gaps` of caches whose rows join, in one table (none for rows that had none; a shorter table's last
    column, for every token after its prompts, repeats)."""
    if all(cache.gaps is None for cache in caches):
        return None
    tables = [cache.gaps if cache.gaps is not None else cache.mask.new_zeros((cache.mask.shape[0], 1), dtype=torch.long)
              for cache in caches]  # fmt: skip
    width = max(table.shape[1] for table in tables)
    return torch.cat([torch.cat([table, table[:, -1:].expand(-1, width - table.shape[1])], dim=1) for table in tables])


def positions_from_mask(mask: torch.BoolTensor, first: torch.LongTensor | int = 0) -> torch.LongTensor:
    """Position of each column: real columns before it (plus `first`); holes get 0, as generate() gives pads (a model
    with learned positions, GPT-2's, computes a pad column's hidden states from it)."""
    positions = mask.long().cumsum(dim=-1) - 1 + (first[:, None] if torch.is_tensor(first) else first)
    return positions.masked_fill(~mask, 0)


def cached_columns(
    cache: DynamicCache | None,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    generation_config: GenerationConfig,
) -> int:
    """How many of the batch's prompt columns a cache passed to generate() already holds (0: a fresh cache). A batch
    continues a filled cache as the target alone does when input_ids are the whole sequences (the cached columns, then
    the new ones) with their attention mask; new tokens alone are refused, since the rows' padding is in the mask."""
    cached = cached_tokens(cache)
    if not cached:
        return 0
    uncached = uncached_prompt_length(cache, input_ids, attention_mask, generation_config)
    if uncached is None:
        raise ValueError(
            f"The cache passed to generate() holds {cached} columns, and input_ids ({input_ids.shape[1]} columns) are "
            "not the whole sequences the attention mask covers: a batch continuing a cache needs the whole padded "
            "sequences, the cached columns included, with an attention mask of the same length."
        )
    held = [layer.keys for layer in cache.layers if _holds_keys(layer)] + [
        state for layer in cache.layers for state in row_states(layer).values()
    ]
    rows = held[0].shape[0] if held else input_ids.shape[0]
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
        and not cached_tokens(cache)
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


# --------------------------------------------------------------------------- trees, and one forward over the cache
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
    inputs_embeds: torch.Tensor | None = None,
    prompt_inputs: dict[str, Any] | None = None,
    output_attentions: bool = False,
):
    """One target forward that appends `input_ids` to every row; holes among them are `new_columns == False`.

    With `tree`, the new columns are a `TreeLayout` of branches after each row's anchor, not one sequence. With
    `inputs_embeds` (the prompt's, as a caller passed them to generate()), the target reads those instead of
    `input_ids`' embeddings, as the target alone does in its first step; so with `prompt_inputs` (a multimodal
    prompt's images or their encodings)."""
    kwargs = dict(prompt_inputs or {})
    if output_attentions:
        kwargs["output_attentions"] = True
    # Asked only when needed (the prefill): reading a signature costs more than the rest of a step's host work.
    if logits_to_keep is not None and "logits_to_keep" in inspect.signature(target.forward).parameters:
        kwargs["logits_to_keep"] = logits_to_keep
    cache.before_forward(new_columns.shape[1])
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
        attention_mask = cache.window.masks(attention_mask, new_columns.shape[1], target.dtype, cache.gaps)
    columns = positions  # the target alone's, read only where it counts them (most targets do not)
    if cache.gaps is not None and cache.counts_columns:
        columns = with_gaps(positions, cache.gaps)
    if cache.by_column:
        positions = columns
    if inputs_embeds is not None:
        kwargs["inputs_embeds"], input_ids = inputs_embeds, None
    temperature = contextlib.nullcontext()
    if cache.temperature is not None:  # a hole's query (the prompt's padding, in a prefill) counts its own column
        own = cache.mask.shape[1] + torch.arange(new_columns.shape[1], device=new_columns.device)
        temperature = cache.temperature.scaled(torch.where(new_columns, columns, own))
    with temperature:
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


__all__ = [
    "RaggedCache",
    "TreeLayout",
    "batch_cache",
    "cached_columns",
    "column_states",
    "columns_of",
    "gather_columns",
    "JOINABLE",
    "joined_gaps",
    "positions_from_mask",
    "put_states",
    "ragged_forward",
]
