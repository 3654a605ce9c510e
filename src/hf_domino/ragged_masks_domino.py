"""The masks and positions of a ragged batch where the target alone counts cache columns, not tokens.

Holes in a batch's cache (`ragged_cache_domino`) are columns that are no token of their row. Where the target alone
counts columns, the batch loop counts each row's tokens instead, plus the columns the prompt's mask leaves out, which
the target alone counts too: a sliding window (`SlidingWindow`, its 4D masks built here), and the positions of a
target whose forward names no `position_ids` (`places_by_column`). Here too how a target's attention takes a
prepared 4D mask (`adds_its_mask`, `formatted_mask`).

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SlidingWindow:
    """A target's sliding-window attention over a ragged cache: a token sees the `size` tokens up to itself.

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

    @classmethod
    def take_over(cls, cache: DynamicCache, target: PreTrainedModel) -> SlidingWindow | None:
        """Makes the sliding layers of `cache` plain dynamic layers and returns their window (None: none slides).

        A filled sliding layer that already dropped the columns before its window (a cache a chat's earlier turns
        filled) gets zeros there: no later token attends to them, and the columns keep their places.

        Raises where the window cannot be kept exactly: layers of different windows, layer types other than full (or
        sparse-indexed) and sliding attention, or an attention implementation that takes no prepared 4D mask (flash
        attention, flex attention)."""
        layers = tuple(i for i, layer in enumerate(cache.layers) if isinstance(layer, DynamicSlidingWindowLayer))
        if not layers:
            return None
        windows = {cache.layers[i].sliding_window for i in layers}
        layer_types = set(getattr(target.config.get_text_config(), "layer_types", None) or ())
        additive = adds_its_mask(target)
        problem = None
        if len(windows) > 1:
            problem = f"its sliding layers have different windows ({sorted(windows)})"
        elif not layer_types <= FULL_ATTENTION | {"sliding_attention"}:
            problem = (
                f"it has attention layers of types {sorted(layer_types)}; only full (and sparse-indexed) and sliding "
                "attention are supported"
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
        return cls(size=windows.pop(), every_layer=every_layer, additive=additive, layers=layers)

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
        only keys fewer than `size` positions before the query (positions: each row's count of its tokens, plus the
        columns its prompt's mask left out before each, `gaps`: the target alone's columns, whose differences count)."""
        columns = torch.arange(real.shape[1], device=real.device)
        causal = columns[None, :] <= columns[-queries:, None]  # [queries, columns]
        full = real[:, None, :] & causal[None]
        positions = real.long().cumsum(dim=-1) - 1
        if gaps is not None:
            positions = with_gaps(positions, gaps)
        near = positions[:, -queries:, None] - positions[:, None, :] < self.size
        sliding = (full & near)[:, None]
        if self.every_layer:
            return self._formatted(sliding, dtype)
        full = self._formatted(full[:, None], dtype)
        return {**dict.fromkeys(FULL_ATTENTION, full), "sliding_attention": self._formatted(sliding, dtype)}

    def _formatted(self, mask: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
        return formatted_mask(mask, self.additive, dtype)


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
    "SlidingWindow",
    "adds_its_mask",
    "formatted_mask",
    "places_by_column",
    "prompt_gaps",
    "takes_no_4d_mask",
    "with_gaps",
]
