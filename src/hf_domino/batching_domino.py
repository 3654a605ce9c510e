"""Batched speculative decoding: one Domino drafter serves a whole left-padded batch inside `generate()`.

transformers' assisted-decoding loop verifies one sequence per target forward. For a batch, `generate()` hands over
to `batch_generate_domino.batched_assisted_decoding` (see the hook in `generate_hook_domino`), which runs
`BatchedDecoding`, a loop of ours built from transformers' pieces
(logits processors, stopping criteria, the streamer protocol, `_speculative_sampling`) and our drafting ladder.

Rows accept different numbers of drafts in a cycle; both caches stay rectangular with holes where rejected drafts
and shorter rows' padding were (`ragged_cache_domino`; the drafter's side in `ragged_batch_domino`; the call's checks
and extra outputs in `batch_call_domino`), so no accepted token is recomputed and no row waits for
another. Rows that finish leave the batch: their cache rows are dropped, and their output is padded exactly as the
target alone pads it.

A cycle drafts one block for every row in one parallel backbone forward (the drafter's cache is ragged the same
way), rolls the Domino head out for all rows at once, and verifies `[anchor, drafts]` for every row in one target
forward of `rows x (1 + k)` tokens. k is chosen per batch: verification is a rectangle, so a row offered fewer drafts
than the widest row saves nothing and can only lose accepted tokens.

Copied drafts work per row as at batch 1: a row whose text repeats offers what followed its last n-gram instead of
its drafted block (else, with a datastore, what the target's earlier answers continue with), where the lookup policy
expects the copies to pay. The drafter runs only when some row still
wants a drafted block, and copied rows are verified by the rule for drafts without a distribution.

Prompts are read by the steps `BatchedDecoding` takes from `batch_prompts_domino.PromptReading`: the prefill of a
`generate()` batch and the prompts a server adds as rows finish (`admit`), in the call's chunks where it asks for them.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList

from .batch_call_domino import TokenScores, check_states_kept_to_a_stop, key_weights
from .batch_drafts_domino import CycleDrafter, CycleDrafts
from .batch_policy_domino import CallWindow, call_speculates
from .batch_prompts_domino import PromptReading
from .cache_domino import buffer_layers
from .copied_drafts_domino import judge_copy
from .cost_model_domino import row_paces, settle_for_timing
from .drafting_domino import CallStops, asked_without_scores, first_stop
from .modeling_domino import TargetModules, context_features, hidden_state_indices
from .options_domino import prefill_chunk_size
from .policy_domino import AdaptivePolicy, FixedPolicy
from .ragged_batch_domino import (
    BatchedDrafterContext,
    accept_rows,
    along,
    pick_tokens,
    process_rows,
    row_criteria,
    row_processors,
)
from .ragged_cache_domino import RaggedCache, TreeLayout, cached_columns, ragged_forward
from .ragged_masks_domino import QueryTemperature, SlidingWindow, adds_its_mask, places_by_column, prompt_gaps
from .recurrent_cache_domino import RecurrentRollback, has_recurrent_layers

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

    from .batch_generate_domino import FinishedRows
    from .modeling_domino import DominoForSpeculation
    from .options_domino import DominoOptions

# The adaptive policy chooses one k for the whole batch; True chooses each row's own k instead (for measuring the
# choice: `hf-domino bench --batch-size ... --methods target,domino,domino_rowk`; see docs/benchmarks.md).
K_PER_ROW = False
# Rows retrieve from the drafter's datastore only while the batch has at most this many active rows (None: in every
# batch). Once cheaper verification came (the cache growing in place, matmul attention), retrieving in every batch paid
# on a 2-core CPU at 4 and 8 rows on both prompt sets (docs/benchmarks.md, "Retrieval in batches of any size"); the
# limit stays for measuring it elsewhere (bench suffix `_lookup2`: at most 2 rows, the previous default).
RETRIEVAL_MAX_ROWS: int | None = None
# A batch is done when its last row is: True prices drafts and copies by the time they save, given the tokens each row
# may still generate and the share of a verification that the batch pays per cycle until its last row finishes
# rather than per row (`cost_model_domino.makespan_tokens`, `BatchVerifyCost.fixed_share`), instead of by the rows'
# mean tokens. Off: on a 2-core CPU, where a forward grows with its rows, it was within noise of the mean at 2-8 rows
# and a few per cent slower on code (docs/benchmarks.md, "A batch's first call", and before it "The target's cache
# grows in place"); measure it on a GPU before choosing (bench suffix `_makespan`).
PRICE_BY_MAKESPAN = False
# With PRICE_BY_MAKESPAN, True prices each row's drafts by its own pace in the call so far (`cost_model_domino.
# row_paces`: a row whose drafts rarely hold will lag, and the batch waits for it) instead of as the pooled rows'. Off:
# the model matches simulated batches of rows that keep their pace, but real rows' paces within a call misled it
# (slower in 7 of 9 first-call comparisons on a 2-core CPU, docs/benchmarks.md, "A batch's first call").
ROW_PACES = False


_NO_TOKENS = torch.zeros((1, 0), dtype=torch.long)  # what a time limit is asked with


class BatchedDecoding(PromptReading):
    """One batched `generate()` call: its rows, both ragged caches, the draft policy, and the steps of a cycle.

    `sequences[row]` is the row's left-padded prompt plus its tokens so far: exactly the input_ids the target alone
    would hand to logits processors and stopping criteria for that row. `active` lists the rows still generating;
    the caches hold those rows only, in that order. A call continuing a filled cache (`cached` columns of the prompt)
    reads the rest of the prompt only, and the drafter starts from there. Rows a server adds later (`admit`, for
    `generate_batch`) hold their prompt unpadded, with their own prompt length and `max_length`; streaming and the
    padded `output` are the `generate()` call's, whose rows share both.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DominoForSpeculation,
        options: DominoOptions,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        stats,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        cache: DynamicCache,
        window: SlidingWindow | None = None,
        inputs_embeds: torch.Tensor | None = None,
        prompt_inputs: dict[str, Any] | None = None,
        finished_rows: FinishedRows | None = None,
    ):
        self.target, self.drafter, self.options, self.stats = target, drafter, options, stats
        # Read by the prefill alone, as the target alone reads them: the prompt's embeddings, and a multimodal
        # prompt's images (videos, audio) or their encodings.
        self.prompt_embeds, self.prompt_inputs = inputs_embeds, prompt_inputs or {}
        # The chunks the prefill reads the prompt in (`prefill_chunk_size`), as the target alone's prefill does.
        self.chunk_size = prefill_chunk_size(generation_config, {"inputs_embeds": inputs_embeds, **self.prompt_inputs})
        self.modules = TargetModules.from_target(target)
        self.layer_ids = drafter.config.target_layer_ids
        # EOS and max_length as the call's criteria say (a user's may stand for generate()'s own): cut inside a block;
        # the other criteria (stop strings, ...) must not fire inside one.
        stops = CallStops.of(stopping_criteria, generation_config, input_ids.device)
        self.do_sample, self.max_length = bool(generation_config.do_sample), stops.max_length
        pad = generation_config._pad_token_tensor  # None: a server's call with neither pad nor EOS token
        self.pad = 0 if pad is None else int(pad.flatten()[0])
        eos = self.ends = stops.ends
        self.eos_ids = set() if eos is None else set(eos.flatten().tolist())
        rows, self.prompt_length = input_ids.shape
        # Without an EOS criterion, transformers' loop pads no finished row: a generate() call's rows then go on
        # writing the target's tokens until the last one stops (`stopped_at`, sticky, in generated tokens). A
        # server's rows (it starts with none) are requests of their own: each ends where it stops; so does one row.
        self.stops_together = not self.eos_ids and rows > 1
        self.stopped_at: list[int | None] = [None] * rows
        # Per row: where its prompt ends and the length it may reach. A batch from generate() shares both; rows a
        # server admits later (`admit`) bring their own.
        self.prompt_lengths, self.max_lengths = [self.prompt_length] * rows, [self.max_length] * rows
        # Each row's stopping criteria (`row_criteria`), all of them and those asked inside a block.
        # A time limit ends the target alone's batch for every row at once, at one column, where a ragged batch's rows
        # stand at columns of their own: the call asks it, not each row (`ends_in_time`). A server's rows (it starts
        # with none) are requests of their own, each ended where it stands.
        self.time_limits = [c for c in stopping_criteria if type(c) is MaxTimeCriteria] if rows > 1 else []
        per_row = [c for c in stopping_criteria if not any(c is limit for limit in self.time_limits)]
        self.stopping_criteria = row_criteria(per_row, rows)
        self.block_criteria = row_criteria([c for c in stops.criteria if any(c is kept for kept in per_row)], rows)
        self.per_row = row_processors(logits_processor, rows)
        # A tree of first-token branches per block (`domino_branches`), verified with a 4D mask of this kind.
        self.branches, self.additive = options.domino_branches, adds_its_mask(target)
        self.device = input_ids.device
        self.mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        self.sequences = list(input_ids)
        self.active = list(range(rows))
        sliding = None if window is None else (window.size, window.decoder_layers(target))
        self.token_scores = TokenScores.wanted(generation_config, self.mask, sliding)
        self.keeps_hidden = self.token_scores is not None and self.token_scores.keep_hidden
        self.keeps_attentions = self.token_scores is not None and self.token_scores.keep_attentions
        # The target's hidden states each forward returns: the drafter's layers, or all where the call returns them.
        self.hidden_layers = True if self.keeps_hidden else hidden_state_indices(self.layer_ids)
        # Steps append in place, into room never taken past what the call can write (its holes aside).
        reserve = options.cache_columns(drafter, self.max_length)
        self.cached = cached_columns(cache, input_ids, attention_mask, generation_config)
        self.target_cache = RaggedCache(
            buffer_layers(cache, reserve), self.mask[:, : self.cached], window=window,
            by_column=places_by_column(target), temperature=QueryTemperature.of(target),
        )  # fmt: skip
        counts_columns = self.target_cache.counts_columns  # the target alone's columns, left padding included
        gaps = prompt_gaps(self.mask) if window is not None or counts_columns else None
        if gaps is not None and not counts_columns and bool((gaps == gaps[:, :1]).all()):
            gaps = None  # left padding alone: a window reads differences of positions, which it changes for none
        self.target_cache.gaps = gaps
        if has_recurrent_layers(cache):  # a replayable scan (generate_hook_domino checked the family)
            check_states_kept_to_a_stop(self.stops_together, stopping_criteria, finished_rows, self.time_limits)
            self.target_cache.recurrent = RecurrentRollback.install_for_rows(cache, target)
        self.context = BatchedDrafterContext.empty(rows, drafter.device)
        # The drafting half: the policies, copied drafts and the head's rollout (each row's left padding is never
        # copied from).
        self.padding = (~self.mask).sum(dim=-1).tolist()
        self.drafting = CycleDrafter(
            drafter, self.modules, options, generation_config, logits_processor, self.block_criteria, self.context,
            self.process, self.now, padding=self.padding, per_row=self.per_row, timings=stats.timings, ends=self.ends,
        )  # fmt: skip
        # Whether this call drafts and copies at all (`call_speculates`), and still (`stops_speculating`), and the
        # cycles the judge of calls weighs against plain steps (a server sets its rows' limit and arrivals there).
        self.speculated = self.speculating = True
        self.drafted_in_call = False
        self.window = CallWindow()
        # Per row, the drafts and copies accepted and the cycles that verified some (any row's), for `row_paces`.
        self.row_accepted, self.row_cycles = [0] * rows, [0] * rows
        # Where a generate() call returns its cache, each row's columns are copied out as it finishes (`FinishedRows`),
        # which the call's output then leaves as the target alone leaves its cache (a server's none: no caller sees it).
        self.finished_rows = finished_rows

    def now(self) -> float:
        """Host time; where the call reads it (`DominoOptions.reads_cycle_times`), after the device finished."""
        settle_for_timing(self.drafter.device, self.options.reads_cycle_times)
        return time.perf_counter()

    # ------------------------------------------------------------------------------------------------------ rows
    def generated(self, row: int) -> int:
        return self.sequences[row].shape[0] - self.prompt_lengths[row]

    def active_sequences(self) -> list[torch.LongTensor]:
        return [self.sequences[row] for row in self.active]

    def process(
        self,
        logits: torch.Tensor,
        extra: torch.LongTensor | None = None,
        repeats: int = 1,
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        """The active rows' (or `rows`') logits `[rows, V]` through their processors, row b after its tokens plus
        `extra[b]` (`[rows x repeats, V]` with `repeats`: each row's `repeats` branches, one after the other)."""
        rows = [row for row in (self.active if rows is None else rows) for _ in range(repeats)]
        return process_rows(
            [self.per_row[row] for row in rows], [self.sequences[row] for row in rows], logits, extra, self.ends
        )

    def extend(
        self, rows: list[int], tokens: list[torch.LongTensor], scores: tuple[torch.Tensor | None, ...] | None = None
    ) -> list[bool]:
        """Appends `tokens[i]` to row `rows[i]`, cut at EOS, max_length and where a stopping criterion fires, as the
        target alone would; per row, whether it is done.

        `scores` are the processed and raw logits the tokens were picked from (`[rows, n, V]` each) and their
        columns' hidden states (`hidden_of`, or None), kept for the tokens appended; passed only where the call
        returns them (`token_scores`). The tokens, then the stopping
        criteria's answers, are read back once for all rows: on a GPU every read waits for the device.
        """
        values, start, done = torch.cat(tokens).tolist(), 0, []
        for i, (row, row_tokens) in enumerate(zip(rows, tokens)):
            sequence = self.sequences[row]
            kept = values[start : start + row_tokens.shape[0]][: self.max_lengths[row] - sequence.shape[0]]
            start += row_tokens.shape[0]
            end = next((at for at, token in enumerate(kept) if token in self.eos_ids), None)
            kept = kept if end is None else kept[: end + 1]
            # A block may hold a draft that completes a stop (`row_limits`): nothing after it is kept, but where
            # rows stop together.
            stop = None
            if self.stopped_at[row] is None:
                stop = first_stop(self.block_criteria[row], sequence, row_tokens[: max(len(kept) - 1, 0)])
            if stop is not None and self.stops_together:
                self.stopped_at[row] = self.generated(row) + stop
            elif stop is not None:
                kept, end = kept[:stop], stop - 1
            if scores is not None:
                self.token_scores.add(row, *(None if each is None else each[i][: len(kept)] for each in scores))
            sequence = self.sequences[row] = torch.cat([sequence, row_tokens[: len(kept)].to(sequence.device)])
            done.append(end is not None or sequence.shape[0] >= self.max_lengths[row])
        asked = [i for i, finished in enumerate(done) if not finished and self.stopped_at[rows[i]] is None]
        if asked:
            answers = [
                asked_without_scores(self.stopping_criteria[rows[i]], self.sequences[rows[i]][None]).any()
                for i in asked
            ]
            for i, answer in zip(asked, torch.stack(answers).tolist()):
                if answer and self.stops_together:
                    self.stopped_at[rows[i]] = self.generated(rows[i])
                else:
                    done[i] = answer
        if self.time_limits:
            done = self.ends_in_time(rows, done)
        return self.stop_together(rows, done) if self.stops_together else done

    def stop_together(self, rows: list[int], done: list[bool]) -> list[bool]:
        """Where rows stop together (`stops_together`): once every row has stopped, the call ends at the column the
        last one stopped at, as the target alone's loop does, its rows cut there; until then, only max_length ends a
        row."""
        if any(at is None for at in self.stopped_at):
            return done
        return self.end_at(max(self.stopped_at), rows)

    def ends_in_time(self, rows: list[int], done: list[bool]) -> list[bool]:
        """Where the call's time limit (`max_time`) has passed, the call ends at the column of the row furthest
        behind of those still generating, every row cut there, as the target alone's batch, whose rows advance
        together, ends at one column: a row whose EOS came before it keeps its end, one whose EOS came after is cut."""
        finished = {row for row, answer in zip(rows, done) if answer}
        generating = [row for row in self.active if row not in finished]
        # Asked of a host tensor: a time limit reads no token, and one of the device's would wait for the device.
        if not generating or not any(bool(limit(_NO_TOKENS, None).all()) for limit in self.time_limits):
            return done
        return self.end_at(min(self.generated(row) for row in generating), rows)

    def end_at(self, end: int, rows: list[int]) -> list[bool]:
        """Ends the call at `end` generated tokens: every row cut there (the cache kept of those finished already
        too); per row of `rows`, whether it is done."""
        for row in range(len(self.sequences)):
            self.max_lengths[row] = min(self.max_lengths[row], self.prompt_lengths[row] + end)
            self.sequences[row] = self.sequences[row][: self.max_lengths[row]]
        if self.finished_rows is not None:  # rows that finished before the end (max_length, an EOS past the end)
            self.finished_rows.cut({row: self.cache_tokens(row) for row in self.finished_rows.order})
        # Once: every row now ends at its max_length, which `extend` reads without this.
        self.stops_together = False
        return [self.sequences[row].shape[0] >= self.max_lengths[row] for row in rows]

    def cache_tokens(self, row: int) -> int:
        """The columns a finished row leaves in the cache: every token but its last (its padding aside), as the
        target alone reads a token in the step after it picks it."""
        return self.sequences[row].shape[0] - self.padding[row] - 1

    def retire(self, finished: list[bool]) -> None:
        """Finished rows leave the batch and both caches (copied out first where the call returns its cache)."""
        keep = [i for i, done in enumerate(finished) if not done]
        if len(keep) == len(self.active):
            return
        if self.finished_rows is not None:
            positions = [i for i, done in enumerate(finished) if done]
            rows = [self.active[i] for i in positions]
            tokens = [self.cache_tokens(row) for row in rows]
            self.finished_rows.add(self.target_cache.copied_rows(positions, tokens), rows)
        index = torch.tensor(keep, dtype=torch.long)
        self.target_cache.select_rows(index)
        self.context.select_rows(index)
        self.active = [self.active[i] for i in keep]

    def stream(self, streamer, emitted: int) -> int:
        """Puts every token column all unfinished rows have reached, as the target alone streams one per step."""
        lengths = [self.generated(row) for row in range(len(self.sequences))]
        ready = min((lengths[row] for row in self.active), default=max(lengths))
        for column in range(emitted, ready):
            at = self.prompt_length + column
            streamer.put(
                torch.tensor([int(s[at]) if column < n else self.pad for s, n in zip(self.sequences, lengths)])
            )
        return ready

    def output(self) -> torch.LongTensor:
        """The rows, padded after their end exactly as the target alone pads them."""
        longest = max(self.generated(row) for row in range(len(self.sequences)))
        sequences = self.sequences[0].new_full((len(self.sequences), self.prompt_length + longest), self.pad)
        for row, sequence in enumerate(self.sequences):
            sequences[row, : sequence.shape[0]] = sequence
        return sequences

    # ----------------------------------------------------------------------------------------------------- steps
    def hidden_of(self, outputs, width: int, path: torch.LongTensor | None = None) -> torch.Tensor | None:
        """Where the call returns hidden states: every layer's, of the forward's last `width` columns (along a tree's
        `path`), `[rows, columns, layers, hidden]`."""
        if not self.keeps_hidden:
            return None
        states = [h[:, -width:] if path is None else along(h[:, -width:], path) for h in outputs.hidden_states]
        return torch.stack(states, dim=2)

    @property
    def policy(self) -> AdaptivePolicy | FixedPolicy | None:
        """The drafter's policy (None until the first cycle builds it)."""
        return self.drafting.policy

    def build_policies(self, anchors: torch.LongTensor) -> None:
        """The drafting half's policies, and whether this call speculates at all (`call_speculates`)."""
        self.drafting.build_policies(self.target, self.target_cache, anchors, self.hidden_layers)
        if self.policy.adaptive:
            self.speculated = self.speculating = call_speculates(self.policy.record)
        if self.speculating:
            self.drafting.index_datastore()

    def find_copies(
        self, room: list[int], rooms: list[int] | None, paces: list[float] | None
    ) -> tuple[dict, dict, dict]:
        """Per active row, the copied drafts it offers this cycle, the copies the lookup policy declined, and each
        row's source (`RowCopies.find`); rows retrieve while at most `RETRIEVAL_MAX_ROWS` rows are active."""
        retrieving = RETRIEVAL_MAX_ROWS is None or len(self.active) <= RETRIEVAL_MAX_ROWS
        return self.drafting.find_copies(self.sequences, self.active, room, retrieving, rooms, paces)

    def verify(
        self, anchors: torch.LongTensor, cycle: CycleDrafts
    ) -> tuple[list[torch.LongTensor], list[int], tuple[torch.Tensor | None, ...], list[int]]:
        """One target forward over every row's `[anchor, drafts]` (or tree); per row, the tokens it adds and drafts
        matched, the processed and raw logits `[rows, 1 + width, V]` its tokens were picked from (the first ones)
        with those columns' hidden states where the call returns them (`hidden_of`), and the drafts it offered (in a
        tree: along the branch the target's first token chose).

        The accepted tokens stay in the target's cache and their hidden states become drafter context; the columns
        of rejected drafts (and of shorter rows' padding, and of the branches not taken) become holes.
        """
        width, device = cycle.width, self.device
        first = anchor_scores = None  # a tree's: the target's token after the anchor, and its processed logits
        before = self.target_cache.mask  # (each forward's mask is a new tensor)
        if cycle.branches is None:
            candidates = cycle.candidates(anchors.to(device))
            lengths = cycle.lengths.to(device)
            new_columns = torch.arange(1 + width, device=device)[None] <= lengths[:, None]
            outputs = ragged_forward(
                self.target, self.target_cache, torch.cat([anchors.to(device), candidates], dim=-1), new_columns,
                self.hidden_layers, output_attentions=self.keeps_attentions,
            )  # fmt: skip
            path = None
            logits = outputs.logits[:, -(1 + width) :].float()
            features = context_features(outputs.hidden_states, self.layer_ids)
            hidden = self.hidden_of(outputs, 1 + width)
        else:
            outputs, candidates, lengths, path, (first, anchor_scores) = self.forward_tree(anchors.to(device), cycle)
            logits = along(outputs.logits[:, -self.target_cache.last_width :].float(), path)
            features = along(context_features(outputs.hidden_states, self.layer_ids), path)
            hidden = self.hidden_of(outputs, self.target_cache.last_width, path)
        if not any(self.per_row[row] for row in self.active):  # no processors: not a copy of [rows, 1 + width, V]
            processed = logits
        else:
            columns = [self.process(logits[:, i], candidates[:, :i]) if i or first is None else anchor_scores
                       for i in range(1 + width)]  # fmt: skip
            processed = torch.stack(columns, dim=1)
        if first is None and self.do_sample and self.branches > 1 and cycle.drafts is not None:
            first = pick_tokens(processed[:, 0], do_sample=True)  # a tree call's block: its first draft was chosen
        copied = cycle.copied(len(self.active))
        tokens, matches = accept_rows(processed, candidates, lengths, cycle.draft_logits(), self.do_sample, copied,
                                      first)  # fmt: skip
        if path is None:
            self.target_cache.keep_appended(self.columns_read(tokens, matches))
        else:  # the anchor and the chosen branch's accepted drafts
            kept = torch.arange(path.shape[1], device=device)[None] <= torch.tensor(matches, device=device)[:, None]
            keep = torch.zeros(path.shape[0], self.target_cache.last_width, dtype=torch.bool, device=device)
            self.target_cache.keep_columns(keep.scatter_(1, path, kept))
        self.context.append(features, [1 + n for n in matches])
        attentions = (
            key_weights(outputs.attentions, before, [1 + n for n in matches]) if self.keeps_attentions else None
        )
        return tokens, matches, (processed, logits, hidden, attentions), cycle.verified()

    def columns_read(self, tokens: list[torch.LongTensor], matches: list[int]) -> list[int]:
        """Per row, the columns of its verification its cache keeps: the anchor and its accepted drafts, where a
        finished row's recurrent states are copied out (`retire`) only through the row's end, its first EOS among its
        new `tokens` or the token that completes a stop (as `extend` cuts); the target alone reads no token past it,
        and a state cannot drop one later."""
        if self.target_cache.recurrent is None or self.finished_rows is None:
            return [1 + n for n in matches]
        values, ends = torch.cat(tokens).tolist(), itertools.accumulate(row.shape[0] for row in tokens)
        rows = [values[end - row.shape[0] : end] for row, end in zip(tokens, ends)]  # read back once for all rows
        read = []
        for row, new, row_tokens in zip(self.active, rows, tokens, strict=True):
            end = next((at + 1 for at, token in enumerate(new) if token in self.eos_ids), len(new))
            stop = first_stop(self.block_criteria[row], self.sequences[row], row_tokens[: end - 1])
            read.append(end if stop is None else stop)
        return read

    def forward_tree(
        self, anchors: torch.LongTensor, cycle: CycleDrafts
    ) -> tuple[Any, torch.LongTensor, torch.LongTensor, torch.LongTensor, tuple[torch.LongTensor, torch.Tensor]]:
        """One target forward over every row's tree: its anchor, then each branch's drafts (`TreeLayout`).

        Returns the outputs and, per row, the branch whose first draft is the target's own next token (its argmax, or
        its draw when sampling; the first branch where none is): its drafts `[rows, k]`, how many the row offers
        there, and its columns `[rows, 1 + k]` in the forward; then that token and the processed logits it came from.
        Along that branch verification is a block's, with the same rule (after the drawn token, when sampling).
        """
        k, rows, device = cycle.width, anchors.shape[0], anchors.device
        # A row's copies can be longer than the drafted branches: their columns past a branch's drafts are holes.
        branches = torch.nn.functional.pad(cycle.branches[:, :, :k], (0, k - min(k, cycle.branches.shape[-1])))
        ids = torch.cat([cycle.candidates(anchors)[:, None], branches.to(device)], dim=1)
        lengths = cycle.offered().to(device)  # [rows, n]
        layout = TreeLayout(ids.shape[1], k, self.additive)
        offered = torch.arange(k, device=device)[None, None] < lengths[..., None]
        new_columns = torch.cat([torch.ones(rows, 1, dtype=torch.bool, device=device), offered.flatten(1)], dim=1)
        outputs = ragged_forward(
            self.target, self.target_cache, torch.cat([anchors, ids.flatten(1)], dim=-1), new_columns,
            self.hidden_layers, tree=layout,
        )  # fmt: skip
        scores = self.process(outputs.logits[:, -layout.width].float())
        picked = pick_tokens(scores, self.do_sample)  # the target's next token
        holds = (ids[:, :, 0] == picked[:, None]) & (lengths > 0)
        branch = holds.long().argmax(dim=-1)  # the first that holds, else 0
        cycle.taken = branch.tolist()
        index = torch.arange(rows, device=device)
        return outputs, ids[index, branch], lengths[index, branch], layout.path(branch), (picked, scores)

    def cycle(self) -> list[bool]:
        """Draft, verify, learn, extend: one target forward for every active row. Returns which rows finished."""
        sequences = self.active_sequences()
        anchors = torch.stack([sequence[-1:] for sequence in sequences]).to(self.drafter.device)
        if self.policy is None:  # its first-use measurements are not this cycle's cost
            self.build_policies(anchors.to(self.device))
        start = self.now()
        self.target_cache.maybe_compact()
        # The target adds one token of its own.
        room = [self.max_lengths[row] - self.sequences[row].shape[0] - 1 for row in self.active]
        rooms = [n + 1 for n in room] if PRICE_BY_MAKESPAN else None  # tokens left, the target's own included
        paces = self.paces() if PRICE_BY_MAKESPAN and ROW_PACES else None
        if isinstance(self.policy, AdaptivePolicy):
            self.policy.verify_cost.rows, self.policy.rooms, self.policy.paces = len(self.active), rooms, paces
        if self.speculating:
            copies, declined, sources = self.find_copies(room, rooms, paces)
            drafts = self.drafting.draft(anchors, self.sequences, self.active, room, set(copies), per_row_k=K_PER_ROW)
            drafts.take_copies(copies, sources)
        else:
            copies, declined, sources = {}, {}, {}
            drafts = CycleDrafts.plain(len(self.active))
        verify_start = self.now()
        tokens, matches, scores, verified_lengths = self.verify(anchors, drafts)
        verify_seconds = self.now() - verify_start
        if self.stats.timings is not None and drafts.drafts is not None:
            self.stats.timings.setdefault("verify", []).append(verify_seconds)
        self.learn(drafts, matches, verified_lengths, verify_seconds)
        for i, found in declined.items():  # judged against what the row generated instead
            offered, accepted = judge_copy(found, tokens[i])
            sources[i].observe(verified=offered, accepted=accepted)
        self.stats.acceptance_lengths.extend(1 + n for n in matches)
        if self.branches > 1:  # a block, or a plain step, goes on along the first branch
            self.stats.branches.extend(drafts.taken or [0] * len(self.active))
        self.stats.drafted.extend(verified_lengths)
        self.stats.copied.extend(drafts.copied(len(self.active), self.drafting.lookup_policy))
        self.stats.retrieved.extend(drafts.copied(len(self.active), self.drafting.datastore_policy))
        finished = self.extend(self.active, tokens, scores if self.token_scores is not None else None)
        end = self.now()
        self.time_cycle(len(self.active), end - start, end - verify_start, drafts)
        return finished

    def time_cycle(self, rows: int, seconds: float, verified_seconds: float, drafts: CycleDrafts) -> None:
        """Logs a cycle for the judge of calls (`CallWindow`): its active rows, its time and, for a plain step, what
        a call taking plain steps only would have paid for it (from the verification on: no lookups, no policy). The
        call's first drafting cycle counts at most what the cost model expects: it reads the prompt's whole context,
        and first in a process pays one-time set-up (see `AdaptivePolicy.observe`)."""
        if drafts.observed["drafted"] and not self.drafted_in_call:
            self.drafted_in_call = True
            if self.policy.adaptive:
                positions = drafts.observed["positions"]
                seconds = min(seconds, self.policy.cycle_seconds(positions, drafts.width, drafts.columns))
        self.window.cycles.append((rows, seconds, verified_seconds if drafts.width == 0 else None))

    def learn(self, cycle: CycleDrafts, matches: list[int], offered: list[int], verify_seconds: float) -> None:
        """The policies learn from the cycle (`CycleDrafter.learn`); each row's pace counts the cycles that verified
        drafts or copies."""
        self.drafting.learn(cycle, matches, offered, verify_seconds)
        if cycle.width and PRICE_BY_MAKESPAN and ROW_PACES:  # counted only where `paces` reads them
            for i, row in enumerate(self.active):
                self.row_accepted[row] += matches[i]
                self.row_cycles[row] += 1

    def paces(self) -> list[float]:
        """The active rows' paces: how well each one's drafts and copies have held in this call against all rows'."""
        paces = row_paces(self.row_accepted, self.row_cycles)
        return [paces[row] for row in self.active]

    def run(self, input_ids: torch.LongTensor, streamer=None) -> torch.LongTensor:
        finished, emitted = self.prefill(input_ids), 0
        while True:
            self.retire(finished)
            if streamer is not None:
                emitted = self.stream(streamer, emitted)
            if not self.active:
                break
            finished = self.cycle()
            self.speculating = self.speculating and not self.losing()
        if streamer is not None:
            streamer.end()
        self.judge_call()
        return self.output()

    @property
    def judges_calls(self) -> bool:
        """Whether the call's cycles are weighed against plain steps: with the adaptive policy, learning times."""
        return self.policy is not None and self.policy.adaptive and self.policy.learn_times

    def losing(self) -> bool:
        """Whether the call's cycles so far lost to plain steps, at a check (`CallWindow.losing`): then it takes plain
        steps for the rest of the call. Asked every cycle: the rows' tokens are counted only at a check."""
        return self.judges_calls and self.window.checks() and self.window.losing(self.policy, self.cycle_tokens())

    def cycle_tokens(self) -> list[int]:
        """Per row, the tokens its cycles generated so far (the prefill picked the first)."""
        return [self.generated(row) - 1 for row in range(len(self.sequences))]

    def judge_call(self) -> None:
        """After the call (a server's window of cycles): whether speculating paid, for this batch size's next calls
        (`batch_policy_domino.judge_call`)."""
        if self.judges_calls:
            self.window.judge(self.policy, self.cycle_tokens(), self.speculated)


__all__ = ["BatchedDecoding"]
