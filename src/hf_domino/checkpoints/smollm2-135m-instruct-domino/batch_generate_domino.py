"""A batch's `generate()` call with a Domino drafter: `batched_assisted_decoding`, what the generate() hook runs for
more than one sequence (or a tree of branches, or a target whose first weights accelerate offloaded).

The call's checks (`batch_call_domino.check_batch_call`), then either the compiled target alone's steps where
generate() compiles the batch's forward, or the drafting loop (`batching_domino.BatchedDecoding`) on the cache the
call starts from (`ragged_cache_domino.batch_cache`), and the output as the target alone returns it, its cache
included (`FinishedRows`, `settled_cache`).

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput

from .batch_call_domino import check_batch_call, compiled_plain_steps, key_weights, prompt_inputs
from .batching_domino import BatchedDecoding
from .cache_domino import CACHE_ARGUMENT
from .ragged_batch_domino import process_rows
from .ragged_cache_domino import RaggedCache, batch_cache, column_states, put_states, ragged_forward
from .recurrent_cache_domino import RecurrentRollback, has_recurrent_layers, put_row_states, row_states

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
    # Kept where the caller sees the cache after the call: it passed one, or asks for the output dict, which carries it.
    finished_rows = FinishedRows() if cache_given or generation_config.return_dict_in_generate else None
    decoding = BatchedDecoding(
        target, drafter, options, generation_config, logits_processor, stopping_criteria, stats, input_ids,
        attention_mask, cache, window, model_kwargs.get("inputs_embeds"), prompt_inputs(model_kwargs),
        finished_rows,
    )  # fmt: skip
    try:
        sequences = decoding.run(input_ids, streamer)
    finally:
        if decoding.target_cache.recurrent is not None:  # the cache's layers as they were built
            decoding.target_cache.recurrent.remove()
    cache = None if finished_rows is None else settled_cache(decoding, finished_rows, sequences)
    if generation_config.return_dict_in_generate:
        scores = logits = hidden_states = attentions = None
        if decoding.token_scores is not None:
            generated = sequences.shape[1] - input_ids.shape[1]
            scores, logits, hidden_states, attentions = decoding.token_scores.columns(generated)
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=scores,
            logits=logits,
            attentions=attentions,
            hidden_states=hidden_states,
            **{CACHE_ARGUMENT: cache},
        )
    return sequences


@dataclass
class FinishedRows:
    """The target's cache rows of a batch's finished rows, copied out as they leave the loop's cache
    (`BatchedDecoding.retire`), for the cache the call returns (`settled_cache`)."""

    pieces: list[RaggedCache] = field(default_factory=list)  # the rows, as they finished
    order: list[int] = field(default_factory=list)  # their rows in the batch

    def add(self, rows_cache: RaggedCache, rows: list[int]) -> None:
        self.pieces.append(rows_cache)
        self.order += rows

    def cut(self, tokens: dict[int, int]) -> None:
        """Keeps each finished row's first `tokens[row]` real columns: the rows of a batch whose rows stop together,
        which may have run past the column the call ends at (`BatchedDecoding.stop_together`)."""
        for piece, rows in self.rows_by_piece():
            counts = torch.tensor([tokens[row] for row in rows], device=piece.mask.device)
            piece.mask = piece.mask & (piece.mask.cumsum(dim=-1) <= counts[:, None])

    def rows_by_piece(self) -> list[tuple[RaggedCache, list[int]]]:
        rows, pieces = iter(self.order), []
        for piece in self.pieces:
            pieces.append((piece, [next(rows) for _ in range(piece.mask.shape[0])]))
        return pieces

    def joined(self) -> RaggedCache | None:
        """The rows in one cache, in the batch's order (None: none kept)."""
        if not self.pieces:
            return None
        rows = RaggedCache.stacked(self.pieces)
        rows.select_rows(torch.tensor(self.order).argsort())
        return rows


def settled_cache(decoding: BatchedDecoding, finished: FinishedRows, sequences: torch.LongTensor) -> DynamicCache:
    """The call's cache as the target alone leaves it for its output `sequences`: each row's tokens but the last
    column's, at the columns of the row's attention mask (zeros in the keys and values where the mask has none), in
    the cache object the call was given, its sliding layers holding their window again, its recurrent layers each
    row's states after those tokens (and the padding the target alone reads after the row's end)."""
    rows = finished.joined()
    ends = torch.tensor([sequence.shape[0] for sequence in decoding.sequences], device=sequences.device)
    before = rows.mask  # (the forward's mask is a new tensor)
    outputs = read_past_ends(
        decoding.target, rows, sequences, ends, decoding.pad, decoding.token_scores is not None, decoding.keeps_hidden,
        decoding.keeps_attentions,
    )  # fmt: skip
    if outputs is not None and decoding.token_scores is not None:
        score_past_ends(decoding, outputs, sequences, ends.tolist(), before)
    answers = decoding.mask.new_ones(sequences.shape[0], sequences.shape[1] - decoding.prompt_length)
    rows.arrange(torch.cat([decoding.mask, answers], dim=-1)[:, :-1])
    cache = decoding.target_cache.cache  # the caller's object, filled in place as the target alone fills it
    for layer, filled in zip(cache.layers, rows.cache.layers):
        put_states(layer, column_states(filled))
        put_row_states(layer, row_states(filled))
        if hasattr(layer, "cumulative_length_linear"):  # what it counts on transformers >= 5.25: columns read
            layer.cumulative_length_linear.fill_(rows.mask.shape[1])
    if rows.window is not None:
        rows.window.hand_back(cache)
    return cache


def read_past_ends(
    target: PreTrainedModel,
    rows: RaggedCache,
    sequences: torch.LongTensor,
    ends: torch.LongTensor,
    pad: int,
    keep_logits: bool = False,
    keep_hidden: bool = False,
    keep_attentions: bool = False,
) -> ModelOutput | None:
    """Reads into `rows` what the target alone reads after each row's end (`ends[row]` tokens), since it steps every
    row until the longest is done: the row's last token, then the padding, up to the output's last column (never
    read). One forward for all rows, after the loop; returns its outputs (None where no row ended early), with the
    logits of every column where `keep_logits`, every layer's hidden states where `keep_hidden` and attention weights
    where `keep_attentions`.

    Recurrent states read every column of a forward, holes too: each row's are the scan over its own columns, from
    the inputs the forward's scan kept (`RecurrentRollback.keep_rows`; two columns at least, where one is stepped in
    place, which keeps none)."""
    missing = sequences.shape[1] - ends
    steps = int(missing.max())
    if not steps:
        return None
    recurrent = has_recurrent_layers(rows.cache)
    if recurrent:
        steps = max(steps, 2)
        rows.recurrent = RecurrentRollback.install_for_rows(rows.cache, target, started=True, widest=steps)
    columns = torch.arange(steps, device=sequences.device)
    new = columns[None] < missing[:, None]
    at = (ends[:, None] - 1 + columns[None]).clamp(max=sequences.shape[1] - 1)
    input_ids = torch.gather(sequences, 1, at).masked_fill(~new, pad)
    try:
        outputs = ragged_forward(
            target, rows, input_ids, new, keep_hidden or [], logits_to_keep=None if keep_logits else 1,
            output_attentions=keep_attentions,
        )  # fmt: skip
        if recurrent:
            rows.recurrent.keep_rows(missing.cpu())
    finally:
        if recurrent:
            rows.recurrent.remove()
            rows.recurrent = None
    return outputs


def score_past_ends(
    decoding: BatchedDecoding,
    outputs: ModelOutput,
    sequences: torch.LongTensor,
    ends: list[int],
    before: torch.BoolTensor,
) -> None:
    """The scores, logits, hidden states and attentions of the columns after each row's end (`output_scores`,
    `output_logits`, `output_hidden_states`, `output_attentions`), as the target alone computes them: from its forward
    over the row's last token and the padding it feeds the row afterwards (`read_past_ends`, on rows whose mask was
    `before`), the logits through the row's processors, each seeing the row's sequence up to there."""
    hidden = decoding.hidden_of(outputs, outputs.logits.shape[1])
    attentions = None
    if decoding.keeps_attentions:
        attentions = key_weights(outputs.attentions, before, [sequences.shape[1] - end for end in ends])
    for column in range(outputs.logits.shape[1]):
        rows = [row for row, end in enumerate(ends) if end + column < sequences.shape[1]]
        raw = outputs.logits[rows, column].float()
        processed = process_rows(
            [decoding.per_row[row] for row in rows], [sequences[row, : ends[row] + column] for row in rows], raw
        )
        for i, row in enumerate(rows):
            states = None if hidden is None else hidden[row, column : column + 1]
            weights = None if attentions is None else attentions[row][column : column + 1]
            decoding.token_scores.add(row, processed[i : i + 1], raw[i : i + 1], states, weights)


__all__ = [
    "FinishedRows",
    "batched_assisted_decoding",
    "read_past_ends",
    "score_past_ends",
    "settled_cache",
]
