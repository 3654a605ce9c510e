"""The masks and positions of a ragged batch where the target alone counts cache columns, not tokens.

Holes in a batch's cache (`ragged_cache_domino`) are columns that are no token of their row. Where the target alone
counts columns, the batch loop counts each row's tokens instead, plus the columns the prompt's mask leaves out, which
the target alone counts too: a sliding window or attention chunk (`SlidingWindow`, its 4D masks built here), the
positions of a target whose forward names no `position_ids` (`places_by_column`), and Llama 4's query temperature
(`QueryTemperature`). Here too how a target's attention takes a prepared 4D mask (`adds_its_mask`, `formatted_mask`).

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

from .cache_domino import set_states

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# Layer types that see every earlier token: sparse attention's indexer (`indexed_attention`: DeepSeek-V3.2-style
# layers beside sliding ones, as in dots.llm3) picks among them within its layer, under the full causal mask.
FULL_ATTENTION = frozenset({"full_attention", "indexed_attention"})
# Layer types that see only some earlier tokens: a sliding window of them, or those of the query's chunk (Llama 4's
# chunked attention: chunks of `attention_chunk_size` tokens, which its cache keeps as sliding layers of that size).
WINDOWED_ATTENTION = frozenset({"sliding_attention", "chunked_attention"})


@dataclass(frozen=True)
class SlidingWindow:
    """A target's sliding-window attention over a ragged cache: a token sees the `size` tokens up to itself; or its
    chunked attention (`layer_type` "chunked_attention", Llama 4's): a token sees those of its chunk up to itself, the
    chunks `size` tokens each, counted from the row's first column after its left padding.

    transformers counts a window in cache columns, which in a left-padded batch are each row's tokens. Holes break
    that (a row's rejected drafts take columns but are no tokens), so over a ragged cache the window is counted in
    each row's own positions, in 4D masks built here (`masks`), and the sliding layers keep every column for the call
    (a sliding layer keeps only its last `size - 1` columns, which holes would make fewer tokens than the window):
    `take_over` makes them full layers, `hand_back` sliding ones again, as the target alone leaves them.
    """

    size: int
    every_layer: bool  # all layers slide (one mask for all); else a dict of masks by layer type, as hybrids take
    additive: bool  # the attention implementation adds its mask (eager) rather than selecting by it (sdpa)
    layers: tuple[int, ...] = ()  # the cache's sliding layers, by index
    layer_type: str = "sliding_attention"  # or "chunked_attention"

    @classmethod
    def take_over(cls, cache: DynamicCache, target: PreTrainedModel) -> SlidingWindow | None:
        """Makes the sliding layers of `cache` plain dynamic layers and returns their window (None: none slides).

        A filled sliding layer that already dropped the columns before its window (a cache a chat's earlier turns
        filled) gets zeros there: no later token attends to them, and the columns keep their places.

        Raises where the window cannot be kept exactly: layers of different windows, layer types other than full (or
        sparse-indexed) and one kind of windowed attention (sliding or chunked), or an attention implementation that
        takes no prepared 4D mask (flash attention, flex attention)."""
        layers = tuple(i for i, layer in enumerate(cache.layers) if isinstance(layer, DynamicSlidingWindowLayer))
        if not layers:
            return None
        windows = {cache.layers[i].sliding_window for i in layers}
        layer_types = set(getattr(target.config.get_text_config(), "layer_types", None) or ())
        additive = adds_its_mask(target)
        problem = None
        if len(windows) > 1:
            problem = f"its sliding layers have different windows ({sorted(windows)})"
        elif not layer_types <= FULL_ATTENTION | WINDOWED_ATTENTION or len(layer_types & WINDOWED_ATTENTION) > 1:
            problem = (
                f"it has attention layers of types {sorted(layer_types)}; only full (and sparse-indexed) attention "
                "beside one kind of sliding or chunked attention is supported"
            )
        elif additive is None:
            problem = takes_no_4d_mask(target)
        if problem is not None:
            raise ValueError(
                f"Batched Domino drafting counts sliding windows in each row's own tokens, which this target's cache "
                f"cannot serve: {problem}. Or generate one prompt at a time."
            )
        for i in layers:
            cache.layers[i] = _full_layer(cache.layers[i])
        every_layer = len(layers) == len(cache.layers)
        layer_type = next(iter(layer_types & WINDOWED_ATTENTION), "sliding_attention")
        return cls(windows.pop(), every_layer, additive, layers, layer_type)

    def decoder_layers(self, target: PreTrainedModel) -> frozenset[int]:
        """The target's sliding decoder layers: by layer type where its config names them (a layer reading another
        layer's cache, Gemma 4's, slides as its type says), else the cache's sliding layers."""
        types = getattr(target.config.get_text_config(), "layer_types", None)
        return (
            frozenset(i for i, kind in enumerate(types) if kind == self.layer_type)
            if types
            else frozenset(self.layers)
        )

    def hand_back(self, cache: DynamicCache) -> None:
        """Makes the layers `take_over` made full (`layers`) sliding ones again, holding their last `size - 1`
        columns, as the target alone's sliding layers hold them after its forwards over the same columns (copies:
        a view would keep every column of the call in memory while the cache waits for a next turn)."""
        for i in self.layers:
            full = cache.layers[i]
            sliding = DynamicSlidingWindowLayer(sliding_window=self.size)
            if full.is_initialized:
                keys, values = (states[:, :, -self.size + 1 :].clone() for states in (full.keys, full.values))
                set_states(sliding, keys, values)
                sliding.cumulative_length = full.keys.shape[-2]
            cache.layers[i] = sliding

    def masks(
        self, real: torch.BoolTensor, queries: int, dtype: torch.dtype, gaps: torch.LongTensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The attention masks of a forward whose last `queries` columns of `real` (`[rows, columns]`, True for a
        row's tokens, False for holes) are its queries: causal over columns, holes masked, and for sliding layers
        only keys fewer than `size` positions before the query, for chunked ones only keys of its chunk (positions:
        each row's count of its tokens, plus the columns its prompt's mask left out before each, `gaps`: the target
        alone's columns, whose differences count for a window, and which count from the row's left padding for a
        chunk)."""
        columns = torch.arange(real.shape[1], device=real.device)
        causal = columns[None, :] <= columns[-queries:, None]  # [queries, columns]
        full = real[:, None, :] & causal[None]
        positions = real.long().cumsum(dim=-1) - 1
        if gaps is not None:
            positions = with_gaps(positions, gaps)
        if self.layer_type == "chunked_attention":
            if gaps is not None:
                positions = positions - gaps[:, :1]  # the left padding, which transformers' chunks do not count
            chunks = torch.div(positions, self.size, rounding_mode="floor")
            near = chunks[:, -queries:, None] == chunks[:, None, :]
        else:
            near = positions[:, -queries:, None] - positions[:, None, :] < self.size
        windowed = (full & near)[:, None]
        if self.every_layer:
            return self._formatted(windowed, dtype)
        full = self._formatted(full[:, None], dtype)
        return {**dict.fromkeys(FULL_ATTENTION, full), self.layer_type: self._formatted(windowed, dtype)}

    def _formatted(self, mask: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
        return formatted_mask(mask, self.additive, dtype)


@dataclass(frozen=True)
class QueryTemperature:
    """Llama 4's attention temperature: its layers without rotary positions (NoPE) scale their queries by
    `log1p(floor((column + 1) / floor_scale)) * attn_scale + 1`, the column the one count of cached columns all rows
    share (the target alone's: each row's tokens and the columns its prompt's mask leaves out). Over a ragged cache
    that count includes holes, so for a batch's forwards (`scaled`) the layers' own scaling is off and each query is
    scaled by its row's own column instead, the same product on the same values."""

    modules: tuple[torch.nn.Module, ...]

    @classmethod
    def of(cls, target: PreTrainedModel) -> QueryTemperature | None:
        """The target's attention modules that scale their queries so (None: none does). Raises where one normalizes
        its queries after `q_proj` (which would undo a scale applied there)."""
        if not getattr(target.config.get_text_config(), "attn_temperature_tuning", False):
            return None
        modules = tuple(
            module for module in target.modules()
            if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)
        )  # fmt: skip
        if any(hasattr(module, "qk_norm") for module in modules):
            raise ValueError(
                f"{type(target).__name__} scales the queries of its layers without rotary positions by their cache "
                "column after a query norm, which a drafted batch cannot count per row: generate one prompt at a time "
                "with the drafter (exact), or the batch without it."
            )
        return cls(modules) if modules else None

    @contextlib.contextmanager
    def scaled(self, columns: torch.LongTensor) -> Iterator[None]:
        """Within: each module's queries scaled by `columns` (`[rows, queries]`, the target alone's column of each
        query of the forward), the scale applied to `q_proj`'s output, where the modules have no query norm after
        it (transformers gives NoPE layers none)."""
        handles, scales = [], {}
        try:
            for module in self.modules:
                module.attn_temperature_tuning = False
                key = (module.floor_scale, module.attn_scale)
                if key not in scales:
                    floors = torch.floor((columns.float() + 1.0) / module.floor_scale)
                    scales[key] = (torch.log1p(floors) * module.attn_scale + 1.0)[..., None]
                handles.append(module.q_proj.register_forward_hook(partial(_times, scales[key])))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for module in self.modules:
                module.attn_temperature_tuning = True


def _times(scales: torch.Tensor, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return (output * scales).to(output.dtype)


def prompt_gaps(mask: torch.BoolTensor) -> torch.LongTensor | None:
    """Per row of a batch's prompt mask, the columns it leaves out, counted before each of the row's tokens: `[rows,
    most tokens + 1]`, entry k before its token k, the last (and those past its own tokens) for every token after the
    prompt. None where the mask leaves out nothing.

    The target alone counts a sliding window in cache columns, and where it places tokens by column
    (`places_by_column`) its positions too: such columns (left padding, padding inside a sequence, an answer's padding
    masked out in a chat's next turn) count there though they are no tokens."""
    before = (~mask).long().cumsum(dim=-1)  # at each column, the left-out columns up to it
    if not mask.numel() or not before[:, -1].any():  # (a server's batch starts with no rows)
        return None
    tokens = mask.sum(dim=-1).tolist()
    table = before[:, -1:].repeat(1, max(tokens) + 1)
    for row, count in enumerate(tokens):
        table[row, :count] = before[row, mask[row]]
    return table


def with_gaps(positions: torch.LongTensor, gaps: torch.LongTensor) -> torch.LongTensor:
    """Tokens' positions (`[rows, n]`, each row's count of its tokens before them) as the target alone's columns:
    plus the columns the prompt's mask left out before each (`prompt_gaps`)."""
    return positions + gaps.gather(1, positions.clamp(0, gaps.shape[1] - 1))


def places_by_column(target: PreTrainedModel) -> bool:
    """Whether the target alone places tokens by cache column: its forward names no `position_ids`, so generate()
    makes none and the model counts every column, those the mask leaves out included."""
    return "position_ids" not in inspect.signature(target.forward).parameters


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
    """A sliding layer as a full one over all the columns it has seen: zeros in those it dropped."""
    if not layer.is_initialized:
        return DynamicLayer()
    dropped = layer.cumulative_length - layer.keys.shape[-2]
    if not dropped:
        return set_states(DynamicLayer(), layer.keys, layer.values)
    keys, values = (torch.nn.functional.pad(kv, (0, 0, dropped, 0)) for kv in (layer.keys, layer.values))
    return set_states(DynamicLayer(), keys, values)


__all__ = [
    "FULL_ATTENTION",
    "QueryTemperature",
    "SlidingWindow",
    "WINDOWED_ATTENTION",
    "adds_its_mask",
    "formatted_mask",
    "places_by_column",
    "prompt_gaps",
    "takes_no_4d_mask",
    "with_gaps",
]
