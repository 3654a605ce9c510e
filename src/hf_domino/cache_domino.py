"""The target's key/value cache as the drafting loops use it: the name `generate()` passes it under, a layer that
grows in place, and how much of a prompt a call that continues a filled cache still has to read. Caches with recurrent
layers (linear attention, state-space models) are `recurrent_cache_domino.py`'s.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    StaticCache,
    StaticLayer,
)
from transformers.generation import GenerationMixin

# transformers 5.24 renamed the key/value cache from `past_key_values` to `cache`: in a model's forward() arguments, in
# generate()'s model_kwargs and in its outputs (the old argument name warns until 5.40). Both releases are supported;
# the name is read off generate()'s own input preparation, which passes it to every model.
CACHE_ARGUMENT = (
    "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)  # fmt: skip


def cache_argument(cache: DynamicCache | None) -> dict[str, DynamicCache | None]:
    """`target(..., **cache_argument(cache))`: the cache under the name this transformers release uses."""
    return {CACHE_ARGUMENT: cache}


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` that appends into spare room instead of concatenating.

    `DynamicLayer.update` copies the whole layer at every step (`torch.cat`): at 8 rows of a few hundred tokens that
    is 3-4% of a step of a small model on a CPU, and it grows with the context. Here `keys`/`values` are views of the
    first columns of larger buffers, and a step writes after them. What replaces them (rows selected, columns
    gathered, offloading) is moved into new buffers at the next update; `crop`'s shorter view is still a prefix, so
    the next step overwrites the cropped columns in place. Same values and shapes; only the storage differs.
    """

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve  # columns the call may reach (its max_length): room is never taken past it early
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.views: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys and values the last update returned

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if not self._writes_in_place(key_states, start, end):
            self._move_to_buffers(key_states, value_states, start, end)
        keys, values = self.buffers
        keys.narrow(-2, start, end - start).copy_(key_states)
        values.narrow(-2, start, end - start).copy_(value_states)
        self.keys, self.values = keys.narrow(-2, 0, end), values.narrow(-2, 0, end)
        self.views = self.keys, self.values
        return self.keys, self.values

    def _writes_in_place(self, key_states: torch.Tensor, start: int, end: int) -> bool:
        """Whether the layer (`start` columns) is still a prefix view of its buffers, with room for `end` columns."""
        if self.buffers is None or end > self.buffers[0].shape[-2]:
            return False
        if start == 0:
            return self.buffers[0].shape[:-2] == key_states.shape[:-2]
        if self.keys is self.views[0] and self.values is self.views[1]:  # the views the last update made: prefixes
            return self.keys.shape[:-2] == key_states.shape[:-2]
        return (
            all(
                view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride()
                for view, buffer in zip((self.keys, self.values), self.buffers)
            )
            and self.keys.shape[:-2] == key_states.shape[:-2]
        )

    def _move_to_buffers(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int, end: int) -> None:
        # Room for a quarter more (at least 256 columns), up to the reserve while within it: a long max_length is not
        # allocated before it is needed, and a regrow costs a step about 1/4 of a column copy per column cached.
        columns = end + max(256, end // 4)
        if end <= self.reserve:
            columns = min(columns, self.reserve)
        self.buffers = tuple(
            states.new_empty((*states.shape[:-2], columns, states.shape[-1])) for states in (key_states, value_states)
        )
        if start:
            self.buffers[0][..., :start, :] = self.keys
            self.buffers[1][..., :start, :] = self.values


def buffer_layers(cache: DynamicCache, reserve: int = 0) -> DynamicCache:
    """Makes the plain dynamic layers of a cache `BufferedLayer`s (others are left as they are). A filled layer (a
    cache passed back for a chat's next turn) keeps its keys and values, moved into buffers at its next update: one
    copy, where concatenating would copy the whole layer at every step of the call."""
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = lambda: BufferedLayer(reserve)
    cache.layers = [_buffered(layer, reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def set_states(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """`layer` holding these keys and values (initialized where it was not); a `BufferedLayer` moves them into new
    buffers at its next update. Returns the layer."""
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if isinstance(layer, BufferedLayer):
        layer.buffers = None
    return layer


def _buffered(layer: DynamicLayer, reserve: int) -> BufferedLayer:
    buffered = BufferedLayer(reserve)
    if layer.is_initialized:
        buffered.__dict__.update({**layer.__dict__, "reserve": reserve, "buffers": None})
    return buffered


def cached_tokens(cache: Cache | None) -> int:
    """How many tokens `cache` holds; a cache without attention layers (a state-space model) counts them on
    transformers >= 5.25 only, before which a filled one is refused."""
    if cache is None:
        return 0
    if cache.layers and not any(isinstance(layer, CacheLayerMixin) for layer in cache.layers):
        if not any(any(getattr(layer, "has_previous_state", {}).values()) for layer in cache.layers):
            return 0
        if not hasattr(cache.layers[0], "cumulative_length_linear"):  # transformers >= 5.25 counts them
            raise ValueError(
                "The cache passed to generate() holds the recurrent states of an earlier call, which do not say how "
                "many tokens they hold on this transformers release, so a call with a drafter cannot tell which of the "
                "prompt's tokens they cover: pass the whole conversation without the cache, generate without the "
                "drafter, or upgrade transformers (5.25 counts them)."
            )
    return int(cache.get_seq_length())  # a static cache's is a tensor


def uncached_prompt_length(
    cache: Cache | None, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, generation_config
) -> int | None:
    """How many of `input_ids` the prefill reads when a call continues a filled `cache` (a multi-turn chat reusing the
    previous turn's cache, a cached system prompt); None when it reads them all.

    transformers' rule for the target alone (`GenerationMixin._prefill`): input_ids as long as the attention mask (or
    as the all-ones mask generate() dropped, `_mask_length`) repeat the cached tokens, and only the rest is read;
    shorter ones are the new tokens alone. Its assisted loop misses this and reads the cached tokens a second time
    (transformers 5.23-5.24, prompt lookup included), so the generate() hook applies the rule for a Domino drafter,
    and the batch loop starts its ragged cache after the cached columns.
    """
    cached = cached_tokens(cache)
    if not cached:
        return None
    mask_length = (
        attention_mask.shape[1] if attention_mask is not None else getattr(generation_config, "_mask_length", -1)
    )
    if mask_length != input_ids.shape[1]:
        return None
    if cached >= input_ids.shape[1]:
        raise ValueError(
            f"The cache passed to generate() already holds {cached} tokens, as many as the prompt has or more "
            f"({input_ids.shape[1]}): nothing is left for the first forward to read. Pass the whole conversation "
            "so far plus at least one new token, or drop the cache's last tokens first (cache.crop(-n))."
        )
    return input_ids.shape[1] - cached


def check_croppable(target, cache: Cache | None, batched: bool) -> None:
    """Raises, naming the fix, for a cache whose layers say they cannot drop the drafts a verification rejects
    (`is_croppable`, transformers >= 5.24: DeepSeek-V4's compressed attention, quantized layers, a static sliding
    layer longer than its window). transformers' assisted loop finds it only after the prefill, with no fix named,
    and a batch would not ask. A batch on a static cache drafts on a dynamic one (`ragged_cache_domino.batch_cache`),
    so it is let be. Linear-attention states are left out: transformers 5.24 calls them uncroppable until they hold a
    state, and their windows crop while their recurrent states roll back here (recurrent_cache_domino)."""
    if cache is None or (batched and isinstance(cache, StaticCache)):
        return
    layers = sorted({type(layer).__name__ for layer in cache.layers if not _keys_croppable(layer)})
    if not layers:
        return
    fix = (
        "generate without the drafter"
        if type(cache) is DynamicCache
        else "use the default dynamic cache (no cache_implementation, no cache of this kind passed in) or generate "
        "without the drafter"
    )
    raise ValueError(
        f"{type(target).__name__}'s {type(cache).__name__} cannot drop the drafts a verification rejects (its "
        f"{', '.join(layers)} layers cannot be cropped), which drafting needs: {fix}."
    )


def _keys_croppable(layer) -> bool:
    """Whether a cache layer's keys and values can drop columns. A layer keeping linear-attention states beside them
    (Falcon-H1's, Inkling's) answers `is_croppable` for its states, `LinearAttentionLayer` coming first in its
    classes, and so does its `crop` unless its own class crops the keys too, as the dynamic ones do: transformers'
    static ones do not (their keys never drop a column), nor can a static sliding layer longer than its window."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return getattr(layer, "is_croppable", True)
    keys = next(
        (cls for cls in type(layer).__mro__
         if issubclass(cls, (DynamicLayer, StaticLayer)) and not issubclass(cls, LinearAttentionCacheLayerMixin)),
        None,
    )  # fmt: skip
    if keys is None:  # states alone, which roll back (recurrent_cache_domino)
        return True
    if "crop" not in vars(type(layer)):
        return False
    answer = inspect.getattr_static(keys, "is_croppable", True)
    return bool(answer.fget(layer) if isinstance(answer, property) else answer)


__all__ = [
    "CACHE_ARGUMENT",
    "BufferedLayer",
    "buffer_layers",
    "cache_argument",
    "cached_tokens",
    "check_croppable",
    "uncached_prompt_length",
]
