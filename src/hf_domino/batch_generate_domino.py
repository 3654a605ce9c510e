"""A batch's `generate()` call with a Domino drafter: `batched_assisted_decoding`, what the generate() hook runs for
more than one sequence (or a tree of branches, or a target whose first weights accelerate offloaded).

The call's checks (`batch_call_domino.check_batch_call`), then either the compiled target alone's steps where
generate() compiles the batch's forward, or the drafting loop (`batching_domino.BatchedDecoding`) on the cache the
call starts from (`ragged_cache_domino.batch_cache`), and the output as the target alone returns it.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .batch_call_domino import check_batch_call, compiled_plain_steps, prompt_inputs
from .batching_domino import BatchedDecoding
from .cache_domino import CACHE_ARGUMENT
from .ragged_cache_domino import batch_cache

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

    from .modeling_domino import DominoForSpeculation
    from .options_domino import DominoOptions


@torch.no_grad()
def batched_assisted_decoding(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter: DominoForSpeculation,
    options: DominoOptions,
    stats,
    streamer=None,
    attention_mask_given: bool = True,
    cache_given: bool = False,
    **model_kwargs: Any,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """Speculative decoding of a left-padded batch: each row's output is what the target alone generates for it.

    Called by the generate() hook for `generate(**batch, assistant_model=drafter)` with more than one sequence
    (`num_return_sequences > 1` included); `stats` is the call's `DominoGenerationStats`. Returns the sequences padded
    as the target alone pads them; the call's cache is left as the target alone leaves it where the caller sees it
    (`cache_given`: generate() was passed one; or the output dict, which carries it).
    """
    attention_mask = model_kwargs.get("attention_mask")
    check_batch_call(
        target, input_ids, attention_mask, logits_processor, generation_config, attention_mask_given, options,
        model_kwargs,
    )  # fmt: skip
    if target._valid_auto_compile_criteria(model_kwargs, generation_config):
        return compiled_plain_steps(
            target, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs
        )
    cache, window = batch_cache(model_kwargs.get(CACHE_ARGUMENT), target)
    decoding = BatchedDecoding(
        target, drafter, options, generation_config, logits_processor, stopping_criteria, stats, input_ids,
        attention_mask, cache, window, model_kwargs.get("inputs_embeds"), prompt_inputs(model_kwargs),
        returns_cache=cache_given or bool(generation_config.return_dict_in_generate),
    )  # fmt: skip
    try:
        sequences = decoding.run(input_ids, streamer)
    finally:
        if decoding.target_cache.recurrent is not None:  # the cache's layers as they were built
            decoding.target_cache.recurrent.remove()
    cache = decoding.settled_cache(sequences)
    if generation_config.return_dict_in_generate:
        scores = logits = None
        if decoding.token_scores is not None:
            scores, logits = decoding.token_scores.columns(sequences.shape[1] - input_ids.shape[1], decoding.pad)
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, **{CACHE_ARGUMENT: cache})
    return sequences


__all__ = ["batched_assisted_decoding"]
