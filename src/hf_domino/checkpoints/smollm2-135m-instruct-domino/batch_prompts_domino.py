"""How a drafted batch reads its prompts: the prefill of a `generate()` batch, and the prompts a server adds later.

`BatchedDecoding` (`batching_domino`) takes these steps from `PromptReading`. Both read left-padded prompts through
the target into a ragged cache (`ragged_cache_domino.ragged_forward`), in the target alone's chunks where the call
asks for them (`prefill_chunk_size`: every chunk but the last read ahead, `read_leading_chunks`), and hand the prompt's
hidden states to the drafter as its context and the last logits to the row's first token (`read_prompt`). A prompt's
copies (`num_return_sequences`, or one prompt sent twice) are read once and share its columns.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .cache_domino import buffer_layers
from .drafting_domino import within_block
from .modeling_domino import check_context_features, context_features, hidden_state_indices
from .ragged_batch_domino import pick_tokens, repeated_rows, row_criteria, row_processors
from .ragged_cache_domino import RaggedCache, batch_cache, ragged_forward

if TYPE_CHECKING:
    from .batching_domino import BatchedDecoding

# Rows that repeat a prompt (`num_return_sequences`' copies) are read once by the prefill and share its columns
# (`repeated_rows`); False reads every copy, as the target alone does (for measuring it: examples/prompt_copies.py).
SHARE_PROMPT_COPIES = True


def left_padded(prompts: list[torch.LongTensor], pad: int) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Prompts of different lengths as one left-padded batch `[rows, longest]`, and which of its columns are real."""
    width, device = max(prompt.shape[0] for prompt in prompts), prompts[0].device
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    real = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - prompt.shape[0] :], real[row, width - prompt.shape[0] :] = prompt, True
    return input_ids, real


class PromptReading:
    """The prompt-reading steps of `BatchedDecoding`, whose rows, caches and drafter context they fill."""

    def prefill(self: BatchedDecoding, input_ids: torch.LongTensor) -> list[bool]:
        """The prompt through the target (its columns after those a filled cache holds): every token it reads becomes
        drafter context, the first token is picked."""
        new, input_ids = self.mask[:, self.cached :], input_ids[:, self.cached :]
        embeds = None if self.prompt_embeds is None else self.prompt_embeds[:, self.cached :]
        self.prompt_embeds = None
        # A prompt's copies (num_return_sequences) are read once and share its columns (and recurrent states), where
        # nothing but its tokens is read (no cache filled before, no embeddings or images).
        plain = not (self.cached or self.prompt_inputs) and embeds is None
        distinct, copies = repeated_rows(input_ids, new) if plain and SHARE_PROMPT_COPIES else (None, None)
        if distinct is not None:
            self.target_cache.select_rows(distinct)
            input_ids, new = input_ids[distinct], new[distinct]
        outputs, leading = self.read_columns(self.target_cache, input_ids, new, embeds, self.prompt_inputs)
        self.prompt_inputs = {}  # the images (their encodings) are in the cache now
        if copies is not None:
            self.target_cache.select_rows(copies)
        contexts, finished = self.read_prompt(outputs, new, self.active, copies, leading)
        self.context.pending = [[features] for features in contexts]
        self.context.known = self.mask.sum(dim=-1).to(self.drafter.device)
        return finished

    def admit(
        self: BatchedDecoding, requests: list[tuple[torch.LongTensor, LogitsProcessorList, StoppingCriteriaList, int]]
    ) -> list[bool]:
        """Adds prompts to the running batch as new rows (requests a server takes on as rows finish): reads them,
        left-padded (in chunks where the call asks for them), into a cache of their own, which joins the batch's
        (`RaggedCache.add_rows`), and picks their first tokens.

        Each request is `(prompt, logits_processor, stopping_criteria, max_length)`, the processors and criteria
        those generate() builds for that prompt alone, so that its row generates what the target alone generates
        for it. Returns which of them finished at their first token.
        """
        rows = list(range(len(self.sequences), len(self.sequences) + len(requests)))
        for prompt, logits_processor, stopping_criteria, max_length in requests:
            self.sequences.append(prompt.to(self.device))
            self.prompt_lengths.append(prompt.shape[0])
            self.max_lengths.append(max_length)
            self.padding.append(0)  # its sequence holds no padding: only its cache columns do
            self.row_accepted.append(0)
            self.row_cycles.append(0)
            self.stopped_at.append(None)
            # In place: the drafting half reads the same lists.
            self.stopping_criteria += row_criteria(stopping_criteria, 1)
            self.block_criteria += row_criteria(within_block(stopping_criteria), 1)
            self.per_row += row_processors(logits_processor, 1)
        input_ids, new = left_padded([self.sequences[row] for row in rows], self.pad)
        distinct, copies = repeated_rows(input_ids, new) if SHARE_PROMPT_COPIES else (None, None)
        if distinct is not None:  # a request's sequences (num_return_sequences) read its prompt once
            input_ids, new = input_ids[distinct], new[distinct]
        cache, _ = batch_cache(DynamicCache(config=self.target.config), self.target)  # the same window as ours
        reserve = self.options.cache_columns(self.drafter, max(self.max_lengths[row] for row in rows))
        own = self.target_cache.holding(buffer_layers(cache, reserve), new[:, :0], None)
        outputs, leading = self.read_columns(own, input_ids, new)
        if copies is not None:
            own.select_rows(copies)
        self.target_cache.add_rows(own)
        self.active += rows
        contexts, finished = self.read_prompt(outputs, new, rows, copies, leading)
        self.context.add_rows(contexts)
        return finished

    def read_columns(
        self: BatchedDecoding,
        cache: RaggedCache,
        input_ids: torch.LongTensor,
        new: torch.BoolTensor,
        inputs_embeds: torch.Tensor | None = None,
        prompt_inputs: dict | None = None,
    ):
        """Prompt columns read into `cache`: their leading chunks where the call asks for chunks
        (`read_leading_chunks`; embeddings are read whole), then the rest in one forward, whose last logits pick the
        first tokens. Returns that forward's outputs and the leading chunks' features (None: read in one forward)."""
        leading = self.read_leading_chunks(cache, input_ids, new) if inputs_embeds is None else None
        read = 0 if leading is None else leading.shape[1]
        outputs = ragged_forward(
            self.target, cache, input_ids[:, read:], new[:, read:], self.hidden_layers, logits_to_keep=1,
            inputs_embeds=inputs_embeds, prompt_inputs=prompt_inputs, output_attentions=self.keeps_attentions,
        )  # fmt: skip
        return outputs, leading

    def read_leading_chunks(
        self: BatchedDecoding, cache: RaggedCache, input_ids: torch.LongTensor, new: torch.BoolTensor
    ) -> torch.Tensor | None:
        """A chunked prefill (`prefill_chunk_size`) up to its last chunk, chunked as transformers' `_prefill` chunks
        the target alone's batch: each chunk of the prompt's columns read into `cache` in turn, so that no forward
        reads more than a chunk per row. Returns their target features `[rows, columns, features]` (None: no chunks
        asked for, or the prompt fits one); the caller's forward reads the last chunk, whose logits pick the first
        tokens (`read_columns`)."""
        if self.chunk_size is None or input_ids.shape[1] <= self.chunk_size:
            return None
        features, recurrent = [], cache.recurrent
        for start in range(0, input_ids.shape[1] - self.chunk_size, self.chunk_size):
            end = start + self.chunk_size
            outputs = ragged_forward(
                self.target, cache, input_ids[:, start:end], new[:, start:end], hidden_state_indices(self.layer_ids),
                logits_to_keep=1,
            )  # fmt: skip
            features.append(context_features(outputs.hidden_states, self.layer_ids))
            if recurrent is not None:  # the next chunk is the prefill's too: never rolled back, so nothing recorded
                recurrent.started = False
        return torch.cat(features, dim=1)

    def read_prompt(
        self: BatchedDecoding,
        outputs,
        new: torch.BoolTensor,
        rows: list[int],
        copies: torch.LongTensor | None = None,
        leading: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """What a prefill over `rows`' prompt columns `new` gives: each row's drafter context (its prompt tokens'
        features) and its first token, appended; returns the contexts and which rows finished there. With `copies`,
        the prefill read each distinct prompt once, and row i is a copy of its `copies[i]`-th row; with `leading`,
        `outputs` are a chunked prefill's last chunk, after chunks whose features these are."""
        logits = outputs.logits[:, -1:].float()
        features = context_features(outputs.hidden_states, self.layer_ids)
        if leading is not None:
            features = torch.cat([leading, features], dim=1)
        hidden = self.hidden_of(outputs, 1)
        if self.keeps_hidden and self.token_scores.prompt_hidden is None:  # generate()'s first step: the prefill's
            self.token_scores.prompt_hidden = tuple(h if copies is None else h[copies] for h in outputs.hidden_states)
        if self.keeps_attentions and self.token_scores.prompt_attentions is None:  # so are its attentions
            self.token_scores.prompt_attentions = tuple(
                self.token_scores.in_window(layer, weights if copies is None else weights[copies])
                for layer, weights in enumerate(outputs.attentions)
            )
        if copies is not None:
            logits, features, new = logits[copies], features[copies], new[copies]
            hidden = None if hidden is None else hidden[copies]
        processed = self.process(logits[:, 0], rows=rows)[:, None]
        first = pick_tokens(processed[:, 0], self.do_sample)  # each copy picks its own
        drafter = self.drafter
        check_context_features(features, drafter.config)
        contexts = [features[i, new[i]].to(drafter.device, drafter.dtype) for i in range(len(rows))]
        keep = self.token_scores is not None
        attentions = [[None] for _ in rows] if self.keeps_attentions else None  # the first step's: the prefill's
        finished = self.extend(rows, list(first[:, None]), (processed, logits, hidden, attentions) if keep else None)
        return contexts, finished


__all__ = ["SHARE_PROMPT_COPIES", "PromptReading", "left_padded"]
