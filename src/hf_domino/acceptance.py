"""Acceptance length (tokens added per target forward), measured one way for every decoding method.

The benchmark and training's evaluation both count it here, from the target's own forward calls, so that the target
alone, prompt lookup, the Domino generator and a hand-written loop are measured identically without reaching into
any of them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .cache_domino import CACHE_ARGUMENT
from .cost_model_domino import MEASURING_COSTS

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@contextlib.contextmanager
def record_target_forwards(target: PreTrainedModel) -> Iterator[list[int]]:
    """Records the target's cache length at the start of each of its forward calls.

    Every decoding loop here keeps all verified tokens but the last one in the target cache, so the cache length at
    forward i + 1 minus the one at forward i is what forward i added.
    """
    cache_lengths: list[int] = []

    # A compiled forward (a static cache with a compile config) runs the hook outside its graph: traced, the list's
    # length became a guard, and the forward was compiled again at every call.
    @torch.compiler.disable
    def pre_hook(module, args, kwargs):
        if MEASURING_COSTS.get():  # the adaptive policy timing forwards (on the call's cache, given back)
            return
        cache = kwargs.get(CACHE_ARGUMENT)
        cache_lengths.append(int(cache.get_seq_length()) if cache is not None else 0)

    handle = target.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield cache_lengths
    finally:
        handle.remove()


def acceptance_from_cache_lengths(cache_lengths: Sequence[int], final_length: int) -> list[int]:
    """Tokens added by each target forward after the prefill, from `record_target_forwards`' cache lengths.

    The first forward is the prefill (cache empty); at every later one the cache holds all verified tokens but the
    last, so the sequence length at the start of forward i is `cache_lengths[i] + 1`.
    """
    starts = [length + 1 for length in cache_lengths[1:]]
    return [end - start for start, end in zip(starts, [*starts[1:], final_length])]


def block_anchors(prompt_length: int, lengths: Sequence[int]) -> list[int]:
    """Position of each decoding forward's anchor (the last token before what it verifies) from its lengths.

    The prefill produces the token at `prompt_length`; each later forward starts from the token the previous one
    produced, so anchor i is `prompt_length + sum(lengths[:i])`. Every forward drafts a block under the fixed policy.
    """
    return list(itertools.accumulate(lengths[:-1], initial=prompt_length))


def mean_acceptance_length(lengths: Sequence[int]) -> float:
    """Tokens per target forward after the prefill; 0.0 when nothing was decoded."""
    return sum(lengths) / len(lengths) if lengths else 0.0


@torch.inference_mode()
def generate_with_acceptance(
    target: PreTrainedModel, input_ids: torch.LongTensor, **generate_kwargs: Any
) -> tuple[torch.LongTensor, list[int]]:
    """`target.generate(input_ids, **generate_kwargs)` and the tokens each of its decoding forwards added."""
    with record_target_forwards(target) as cache_lengths:
        output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **generate_kwargs)
    return output, acceptance_from_cache_lengths(cache_lengths, output.shape[1])
