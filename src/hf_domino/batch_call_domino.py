"""What a batched call with a Domino drafter may ask, and what it returns besides the sequences.

`check_batch_call` refuses, naming the fix, what the batch loop cannot do exactly (right padding, padding without
an attention mask, attention biased by cache column, per-step attentions or hidden states, trees it cannot verify);
`TokenScores` keeps each row's scores and logits for `output_scores`/`output_logits`; `compiled_plain_steps` is the
call where generate() compiles the target's forward on a static cache, which the loop's holes cannot use.
`batching_domino` runs the loop itself.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL

from .cache_domino import CACHE_ARGUMENT
from .ragged_cache_domino import positions_from_mask
from .ragged_masks_domino import adds_its_mask, takes_no_4d_mask

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from .batch_generate_domino import FinishedRows
    from .options_domino import DominoOptions

# Model types whose attention depends on where a key sits in the cache, not on the row's own positions: holes would
# change their outputs. (Bloom and Falcon derive ALiBi from the attention mask, which skips holes, and are exact.)
COLUMN_BIASED_ATTENTION = {"mpt"}
# Model types that build ALiBi biases from the 2D attention mask they are given (Falcon where `alibi` is set): a
# tree's branches need a 4D mask, which those models cannot read.
ALIBI_FROM_THE_MASK = {"bloom", "falcon"}
# What generate() hands its loop that the batch loop reads or makes itself; any other input the target's forward names
# (a vision model's pixel_values, say) would reach the target alone's first step and not the batch's.
BATCH_LOOP_INPUTS = {
    "attention_mask", "position_ids", "inputs_embeds", "use_cache", "logits_to_keep", "cache", "past_key_values",
    "cache_position", "output_attentions", "output_hidden_states", "return_dict",
}  # fmt: skip
# What transformers hands a multimodal target at its first step only (images, videos, audio, or their encodings): the
# batch loop's prefill reads them too (`prompt_inputs`).
PREFILL_ONLY_INPUTS = frozenset(MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL)


def prompt_inputs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The inputs of generate()'s `model_kwargs` that the target reads with the prompt alone (an empty encoding of a
    text-only call dropped)."""
    return {
        name: value for name, value in model_kwargs.items()
        if name in PREFILL_ONLY_INPUTS and value is not None and not (isinstance(value, dict) and not value)
    }  # fmt: skip


def check_batch_target(target: PreTrainedModel, generation_config: GenerationConfig, options: DominoOptions) -> None:
    """Raises, naming the fix, where the target (or a tree of branches on it) cannot keep holes in its cache exactly:
    any batched call, `generate()`'s or `generate_batch`'s."""
    if options.domino_branches > 1:
        _check_tree_call(target, options.domino_branches)
    if target.config.get_text_config().model_type in COLUMN_BIASED_ATTENTION:
        raise ValueError(
            f"{type(target).__name__} biases attention by cache column (ALiBi over columns), and the holes a drafted "
            "batch leaves in the cache would change those distances: generate one prompt at a time with the drafter "
            "(exact), or the batch without it."
        )


def check_states_kept_to_a_stop(
    stops_together: bool,
    stopping_criteria: StoppingCriteriaList,
    finished_rows: FinishedRows | None,
    time_limits: list[MaxTimeCriteria],
) -> None:
    """Refuses a batch of a recurrent target whose rows stop together (no EOS token) at a criterion, or at a time
    limit, and whose cache the call returns: a row that ran past the column the call ends at could not take its
    states back."""
    if time_limits and finished_rows is not None:
        raise ValueError(
            "max_time ends every row of the target alone's batch at the same column, where a drafted batch's rows "
            "stand at columns of their own: those ahead are cut back, and the target's recurrent states cannot be cut "
            f"back for the cache the call returns. Return no cache (return_dict_in_generate=False and no "
            f"{CACHE_ARGUMENT}=), drop max_time, or generate without assistant_model."
        )
    if (
        stops_together
        and finished_rows is not None
        and any(not isinstance(criterion, MaxLengthCriteria) for criterion in stopping_criteria)
    ):
        raise ValueError(
            "This batch has no EOS token, so its rows run on until the last one stops (at a stop string or "
            "criterion), as the target alone's do, and the target's recurrent states cannot be cut back to where "
            f"the call then ends for the cache it returns: pass eos_token_id, or return no cache "
            f"(return_dict_in_generate=False and no {CACHE_ARGUMENT}=), or generate without assistant_model."
        )


def check_batch_call(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    logits_processor: LogitsProcessorList,
    generation_config: GenerationConfig,
    attention_mask_given: bool,
    options: DominoOptions,
    model_kwargs: dict[str, Any] | None = None,
) -> None:
    """Raises, naming the fix, for what a batched call cannot do exactly (`model_kwargs`: generate()'s, for its
    loop)."""
    check_batch_target(target, generation_config, options)
    one_at_a_time = (
        "generate one prompt at a time" if input_ids.shape[0] > 1 else _one_sequence_fix(generation_config, options)
    )
    _check_model_inputs(target, input_ids, attention_mask, generation_config, model_kwargs or {}, one_at_a_time)
    if generation_config._pad_token_tensor is None:
        raise ValueError("Batched generation needs a pad token: set pad_token_id (e.g. tokenizer.pad_token_id).")
    empty = [] if attention_mask is None else (~attention_mask.bool().any(dim=-1)).nonzero()[:, 0].tolist()
    if empty:
        raise ValueError(
            f"Row(s) {empty} of the batch hold no token at all (an empty prompt: its attention_mask is all 0), and a "
            "decoder-only target has nothing to continue there. Drop the empty prompts, or start every prompt with a "
            "token (the tokenizer's BOS token, say)."
        )
    if attention_mask is not None and not bool(attention_mask[:, -1].all()):
        raise ValueError(
            "The batch is right-padded (its attention_mask ends in 0 on some rows): a decoder-only target continues "
            "from the last column. Pad on the left: tokenizer.padding_side = 'left'."
        )
    pad = generation_config._pad_token_tensor.to(input_ids.device)
    if not attention_mask_given and bool(torch.isin(input_ids[:, 0], pad).any()):
        raise ValueError(
            "The batch holds padding but generate() got no attention_mask, so padding cannot be told from text. Pass "
            "the attention_mask the tokenizer returns: target.generate(**tokenizer(prompts, padding=True, "
            "return_tensors='pt'), assistant_model=drafter), the tokenizer padding on the left (tokenizer.padding_side = "
            "'left')."
        )
    if generation_config.return_dict_in_generate and generation_config.output_attentions:
        _check_attentions_call(target, options, one_at_a_time)


def _one_sequence_fix(generation_config: GenerationConfig, options: DominoOptions) -> str:
    """What takes one sequence back to transformers' loop, which runs what the batch loop refuses (the generate()
    hook hands it to the batch loop for these reasons only)."""
    if options.domino_branches > 1:  # a tree's forward holds the branches as rows
        return "drop domino_branches"
    if generation_config.output_hidden_states or generation_config.output_attentions:  # not returned as alone's there
        return "drop output_hidden_states and output_attentions"
    return "keep the target's first weights on a device rather than offloaded"


def _check_multimodal_prompt(target: PreTrainedModel, model_kwargs: dict[str, Any], one_at_a_time: str) -> None:
    """Raises, naming the fix, where a batch's prompt holds images (videos, audio) its loop cannot feed as the target
    alone's first step does."""
    if any(hasattr(module, "get_rope_index") for module in (target, getattr(target, "model", None))):
        raise ValueError(
            f"{type(target).__name__} places an image's tokens by rotary positions of several sections (multimodal "
            "RoPE), which a drafted batch does not compute (it counts each row's tokens): "
            f"{one_at_a_time} with images, which transformers' own loop runs, or the batch without the drafter."
        )
    cache = model_kwargs.get(CACHE_ARGUMENT)
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            "A drafted batch reads a multimodal prompt's images in its first forward over the whole prompt, and the "
            f"cache passed to generate() already holds some of it: {one_at_a_time}, or pass the prompt without the "
            "cache."
        )


def _check_model_inputs(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    one_at_a_time: str,
) -> None:
    """Raises, naming the fix, where generate() gives the target inputs the batch loop would not feed it as the target
    alone's first step reads them (the loop feeds ids, embeddings and mask positions, and mixes no drafter in)."""
    named = inspect.signature(target.forward).parameters
    unread = sorted(
        name for name, value in model_kwargs.items()
        if value is not None and name in named and name not in BATCH_LOOP_INPUTS | PREFILL_ONLY_INPUTS
    )  # fmt: skip
    if unread:
        raise ValueError(
            f"generate() got {', '.join(unread)} for the target, which a drafted batch does not pass on to it (its "
            f"loop feeds the target token ids, their embeddings and positions, and a multimodal prompt's inputs to "
            f"its first forward): {one_at_a_time}, which transformers' own loop runs with every input, or generate "
            "the batch without the drafter."
        )
    if prompt_inputs(model_kwargs):
        _check_multimodal_prompt(target, model_kwargs, one_at_a_time)
    if generation_config.assistant_ensemble_weight is not None:
        raise ValueError(
            "assistant_ensemble_weight mixes the drafter's distribution into transformers' own loop, which verifies one "
            f"linear block of one sequence; a drafted batch or tree does not mix it: {one_at_a_time}, or drop "
            "assistant_ensemble_weight."
        )
    inputs_embeds, position_ids = model_kwargs.get("inputs_embeds"), model_kwargs.get("position_ids")
    if inputs_embeds is not None and inputs_embeds.shape[:2] != input_ids.shape:
        raise ValueError(
            f"inputs_embeds {tuple(inputs_embeds.shape[:2])} came without token ids of the same shape (got "
            f"{tuple(input_ids.shape)}): a drafted batch reads the prompts' ids beside their embeddings (copied drafts, "
            "logits processors, stopping criteria and the returned sequences use them). Pass input_ids too (the "
            f"target still reads inputs_embeds for the prompt), or {one_at_a_time}: transformers' own loop takes "
            "inputs_embeds alone for one sequence."
        )
    if position_ids is not None and not counts_the_mask(position_ids, input_ids, attention_mask):
        raise ValueError(
            "A drafted batch places each row's tokens by its attention mask (position = the real tokens before it), "
            "as generate() does when given no position_ids, and these position_ids say otherwise: drop position_ids, "
            f"or {one_at_a_time} (transformers' own loop continues the positions it is given)."
        )
    if generation_config.token_healing and attention_mask is not None and attention_mask.shape != input_ids.shape:
        # generate() re-tokenizes the prompts for token_healing (dropping special tokens, a chat template's among them)
        # and keeps the mask it had; the target alone then reads a mask of other tokens.
        raise ValueError(
            f"The prompts' token ids are {tuple(input_ids.shape)} but their attention_mask {tuple(attention_mask.shape)}"
            ": a drafted batch needs the mask of the very tokens it continues. token_healing changes the prompts after "
            f"the mask was made (it re-tokenizes them without special tokens): {one_at_a_time} (transformers' own loop "
            "heals one sequence), or tokenize the prompts healed and drop token_healing."
        )


def counts_the_mask(
    position_ids: torch.Tensor, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None
) -> bool:
    """Whether `position_ids` (what generate() hands its loop) are the positions the mask gives each real token, the
    count of real tokens before it: what generate() makes when given none (pads aside, which it sets to 0). A
    multimodal-RoPE target's (`[sections, rows, columns]`: Qwen2-VL to Qwen3.5) count it in every section for text."""
    if position_ids.dim() == 3:
        return all(counts_the_mask(section, input_ids, attention_mask) for section in position_ids)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if position_ids.dim() != 2 or position_ids.shape[0] != mask.shape[0] or position_ids.shape[1] < mask.shape[1]:
        return False
    given = position_ids[:, -mask.shape[1] :].to(mask.device)
    return bool((given == positions_from_mask(mask))[mask].all())


def _other_than_full_attention(target: PreTrainedModel) -> str | None:
    """What the target's attention is other than full attention over every cached column, or None."""
    if others := sorted(set(getattr(target.config.get_text_config(), "layer_types", None) or ()) - {"full_attention"}):
        return f"the target has {', '.join(others)} layers"
    if any(isinstance(layer, DynamicSlidingWindowLayer) for layer in DynamicCache(config=target.config).layers):
        # A sliding window without layer types (Mistral's `sliding_window`): its cache says so.
        return "the target's attention slides over a window"
    return None


def _check_attentions_call(target: PreTrainedModel, options: DominoOptions, one_at_a_time: str) -> None:
    """Raises, naming the fix, where a batched call cannot return the target alone's attentions: a tree verifies
    several branches in one query block, and attention other than full or sliding (chunked, sparse-indexed) holds
    keys the batch's cache does not lay out as the target alone's does."""
    problem = "domino_branches verifies several branches at once" if options.domino_branches > 1 else None
    layer_types = set(getattr(target.config.get_text_config(), "layer_types", None) or ())
    if problem is None and (others := sorted(layer_types - {"full_attention", "sliding_attention"})):
        problem = f"the target has {', '.join(others)} layers"
    if problem is not None:
        raise ValueError(
            f"A batch drafted with a Domino drafter returns attentions of full and sliding-window attention only, and "
            f"{problem}: drop output_attentions (output_scores, output_logits and output_hidden_states work), or "
            f"{one_at_a_time}."
        )


def _check_tree_call(target: PreTrainedModel, branches: int) -> None:
    """Raises, naming the fix, where a call cannot verify trees of `branches` branches."""
    problem, config = None, target.config.get_text_config()
    if adds_its_mask(target) is None:
        problem = takes_no_4d_mask(target)
    elif (other := _other_than_full_attention(target)) is not None:
        problem = f"{other} (trees take full-attention targets only)"
    elif config.model_type in ALIBI_FROM_THE_MASK and getattr(config, "alibi", True):
        problem = (
            f"{type(target).__name__} builds its ALiBi biases from a 2D attention mask, and a tree needs a 4D one"
        )
    if problem is not None:
        raise ValueError(f"domino_branches={branches} cannot serve this call: {problem}. Or drop domino_branches.")


class TokenScores:
    """What `output_scores`, `output_logits`, `output_hidden_states` and `output_attentions` return for a batch: per
    row, the processed and raw logits each of its tokens was picked from, the hidden states (every layer's) of the
    column that gave them and that column's attention weights over the keys it saw; then as generate() returns them:
    one `[rows, V]` tensor per generated column, per generated column a tuple of `[rows, 1, hidden]` per layer, and
    per generated column a tuple of `[rows, heads, 1, keys]` per layer (the first column's: the prefill's, over the
    whole prompt).

    A row that has finished emits the pad token in every later column. The target alone computes its scores, hidden
    states and attentions there from the pad tokens it feeds the row, which the call reads after its loop
    (`batch_generate_domino.score_past_ends`): every row has one per generated column.
    """

    def __init__(
        self,
        kept: list[bool],
        prompt_mask: torch.BoolTensor,
        window: tuple[int, frozenset[int]] | None = None,
    ):
        self.keep_scores, self.keep_logits, self.keep_hidden, self.keep_attentions = kept
        self.rows: list[list[tuple[Any, ...]]] = [[] for _ in range(prompt_mask.shape[0])]
        # The prefill's, per layer (`read_prompt`).
        self.prompt_hidden: tuple[torch.Tensor, ...] | None = None
        self.prompt_attentions: tuple[torch.Tensor, ...] | None = None
        # Where the target alone's keys are: the call's attention mask over the prompt's columns (0: padding), and
        # its sliding window's size and sliding layers, whose keys its cache crops (`in_window`).
        self.prompt_mask, self.window = prompt_mask, window

    @classmethod
    def wanted(
        cls,
        generation_config: GenerationConfig,
        prompt_mask: torch.BoolTensor,
        window: tuple[int, frozenset[int]] | None = None,
    ) -> TokenScores | None:
        """The call's record (its rows: the mask's), or None where it returns none of them."""
        kept = [
            bool(generation_config.return_dict_in_generate and getattr(generation_config, name))
            for name in ("output_scores", "output_logits", "output_hidden_states", "output_attentions")
        ]
        return cls(kept, prompt_mask, window) if any(kept) else None

    def add(
        self,
        row: int,
        scores: torch.Tensor,
        logits: torch.Tensor,
        hidden: torch.Tensor | None = None,
        attentions: list[torch.Tensor] | None = None,
    ) -> None:
        """A row's next tokens' processed (`scores`) and raw logits, `[n, V]` each, the hidden states of their
        columns, `[n, layers, hidden]` (copied: they are views of a whole forward's), and per token its column's
        attention weights over the real keys it saw, in order (`key_weights`: `[layers, heads, keys]`)."""
        kept = (scores, logits, hidden, attentions)
        wanted = (self.keep_scores, self.keep_logits, self.keep_hidden, self.keep_attentions)
        self.rows[row].append(tuple(
            None if not keep else list(each) if isinstance(each, list) else each.clone()
            for each, keep in zip(kept, wanted)
        ))  # fmt: skip

    def columns(self, length: int) -> tuple[tuple | None, ...]:
        """(scores, logits, hidden states, attentions) as generate() returns them for `length` generated columns,
        each None where not asked."""
        scores = self._columns(0, length) if self.keep_scores else None
        logits = self._columns(1, length) if self.keep_logits else None
        hidden = self._hidden_states(length) if self.keep_hidden else None
        attentions = self._attentions(length) if self.keep_attentions else None
        return scores, logits, hidden, attentions

    def _columns(self, kind: int, length: int) -> tuple[torch.Tensor, ...]:
        per_row = torch.stack([torch.cat([pieces[kind] for pieces in row])[:length] for row in self.rows])
        return tuple(per_row.unbind(1))

    def _hidden_states(self, length: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        per_row = torch.stack([torch.cat([pieces[2] for pieces in row])[:length] for row in self.rows])
        # [rows, columns, layers, hidden]: column 0's are the prefill's over the whole prompt, as the target alone's.
        later = tuple(tuple(layer[:, None] for layer in per_row[:, column].unbind(1)) for column in range(1, length))
        return (self.prompt_hidden, *later)

    def _attentions(self, length: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Column g >= 1 as the target alone's step g returns it: over the prompt's columns and g generated ones, its
        keys are the columns of the call's attention mask and every generated column, and padding weighs 0."""
        per_row = [[weights for pieces in row for weights in pieces[3]][:length] for row in self.rows]
        later = []
        for column in range(1, length):
            layout = torch.nn.functional.pad(self.prompt_mask, (0, column), value=True)
            weights = [row[column] for row in per_row]
            steps = weights[0].new_zeros(len(per_row), *weights[0].shape[:2], layout.shape[1])
            for row, row_weights in enumerate(weights):
                steps[row][..., layout[row]] = row_weights
            # [rows, heads, 1, keys] per layer
            later.append(tuple(self.in_window(i, layer[:, :, None]) for i, layer in enumerate(steps.unbind(1))))
        return (self.prompt_attentions, *later)

    def in_window(self, layer: int, weights: torch.Tensor) -> torch.Tensor:
        """A layer's weights `[rows, heads, queries, keys]` over the keys the target alone's cache hands its forward:
        a sliding layer keeps its last `window - 1` columns (transformers' `DynamicSlidingWindowLayer`) before the
        forward's own; no other layer drops any. The weights dropped are 0: outside the window."""
        if self.window is None or layer not in self.window[1]:
            return weights
        queries, keys = weights.shape[-2:]
        return weights[..., keys - min(keys - queries, self.window[0] - 1) - queries :]


def key_weights(
    attentions: tuple[torch.Tensor, ...], before: torch.BoolTensor, counts: list[int]
) -> list[list[torch.Tensor]]:
    """Per row, for each of a forward's first `counts[row]` columns, its query's attention weights over the real keys it
    saw, in order: the row's real columns before the forward (`before`, the cache's mask then), then the forward's own
    up to that column; `[layers, heads, keys]` each. The weights of holes, which the target alone never holds, are 0."""
    stacked = torch.stack(attentions, dim=1)  # [rows, layers, heads, queries, columns]
    device = stacked.device
    # Each row's real columns, in order, read back once for all rows.
    real = before.nonzero()[:, 1].to(device).split(before.sum(dim=-1).tolist())
    new = before.shape[1] + torch.arange(max(counts, default=0), device=device)
    weights = []
    for row, (seen, count) in enumerate(zip(real, counts)):
        keys = torch.cat([seen, new[:count]])
        weights.append([stacked[row, :, :, query, keys[: len(seen) + query + 1]] for query in range(count)])
    return weights


def compiled_plain_steps(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer: Any,
    model_kwargs: dict[str, Any],
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """A batch where generate() compiles the target's forward on a static cache: transformers' own decoding, compiled.

    The batch loop keeps holes in a dynamic cache and runs the forward eagerly; against the compiled target alone it
    measured slower (a CPU, 2 and 4 rows: 0.64x and 0.79x; docs/benchmarks.md), so the batch takes the compiled plain
    steps instead."""
    warnings.warn(
        "This call decodes without drafting: generate() compiles the target's forward on its static cache, which a "
        "Domino drafter's batch loop cannot use, and drafting without it measured slower than the compiled target "
        "alone. The output is the same. To draft a batch, pass cache_implementation='dynamic' (or "
        "disable_compile=True).",
        stacklevel=3,
    )
    return target._sample(
        input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer, **model_kwargs
    )


__all__ = [
    "COLUMN_BIASED_ATTENTION",
    "PREFILL_ONLY_INPUTS",
    "TokenScores",
    "check_batch_call",
    "check_batch_target",
    "check_states_kept_to_a_stop",
    "compiled_plain_steps",
    "key_weights",
    "prompt_inputs",
]
