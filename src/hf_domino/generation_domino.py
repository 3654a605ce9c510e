"""Domino drafting inside transformers' own assisted-decoding loop: the candidate generator.

`DominoCandidateGenerator` is a thin adapter between transformers' `CandidateGenerator` interface and the drafting
ladder of `drafting_domino` (what to draft) and the policy of `policy_domino` (how many drafts to verify).
`generate(..., assistant_model=drafter)` reaches it through the hook of `generate_hook_domino`, which hands it the
call's options and stopping criteria.
This file is also written next to exported checkpoints as remote code, so it imports only transformers and torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import EosTokenCriteria, StoppingCriteriaList

from .cache_domino import CACHE_ARGUMENT, cached_tokens
from .copied_drafts_domino import certain_logits, judge_copy, lookup_drafts
from .cost_model_domino import (
    VerifyCost,
    measure_verify_cost,
    measure_verify_cost_on_scratch,
    settle_for_timing,
    timing_is_free,
    verify_cost_for,
)
from .drafting_domino import (
    BlockDraft,
    CallStops,
    DrafterContext,
    Drafts,
    drafting_vocab,
    eager_rollout,
    greedy_pick,
    processed_pick,
    reads_the_tokens,
    run_backbone,
    score_only,
    select_fused_rollout,
    spread_to_vocabulary,
    stop_free_length,
)
from .modeling_domino import TargetModules, check_context_features, context_features, hidden_state_indices
from .options_domino import DominoGenerationStats, DominoOptions, check_drafter_for_target, checked_datastore
from .policy_domino import AdaptivePolicy, FixedPolicy, LookupPolicy
from .records_domino import DraftingMode, copy_records, drafter_record
from .recurrent_cache_domino import RecurrentRollback, rolls_back

if TYPE_CHECKING:
    from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

    from .drafting_domino import Rollout
    from .modeling_domino import DominoForSpeculation


# ------------------------------------------------------------------------------------------------ candidate generator
def ends_the_loop_runs_past(ends: torch.Tensor | None, generation_config: GenerationConfig) -> list:
    """The call's EOS ids that transformers' assisted loop does not cut an accepted block after (it cuts after its
    config's only), as a criterion a block must not fire: a block then offers no such draft, and the target's own
    token, the last of its cycle, decides, as it does a stop string's last token. Empty where a user's criterion
    adds no EOS id to the config's."""
    cut = getattr(generation_config, "_eos_token_tensor", None)
    if ends is not None and cut is not None:
        ends = ends[~torch.isin(ends, cut.to(ends.device))]
    return [] if ends is None or not ends.numel() else [EosTokenCriteria(ends)]


class DominoCandidateGenerator(CandidateGenerator):
    """Drafts for transformers' assisted-decoding loop: an adapter from its interface to the drafting ladder.

    The loop hands us the target's outputs of the previous verification (`requires_model_outputs`): their hidden
    states at `target_layer_ids` for the tokens that were accepted become drafter context. The drafter's cache only
    ever holds verified context, so a rejection needs no rollback on our side. Each call then asks the draft policy
    how many drafts to compute (0: a plain target step), drafts them, and lets the policy choose how many to offer.
    """

    requires_model_outputs = True

    def __init__(
        self,
        drafter: DominoForSpeculation,
        target: PreTrainedModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        input_ids: torch.LongTensor | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        options: DominoOptions | None = None,
        prefill_length: int | None = None,
        rollback: RecurrentRollback | None = None,
        leading_features: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        if options is None:  # built directly rather than through generate(): validate here
            check_drafter_for_target(drafter, target, generation_config)
            options = DominoOptions.resolve({}, generation_config)
            options.validate(drafter)
        if input_ids is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"DominoCandidateGenerator drafts for one sequence (got {input_ids.shape[0]}): transformers' assisted "
                "loop verifies one sequence per target forward. Pass the whole batch to target.generate(..., "
                "assistant_model=drafter), which serves it through hf_domino.batching_domino."
            )
        self.drafter, self.target_model, self.options = drafter, target, options
        # The prompt tokens the prefill reads when the call continues a filled cache (None: the whole prompt).
        self.prefill_length = prefill_length
        # A target with recurrent layers: a verification with a rejected draft is rolled back whole (RecurrentRollback).
        self.rollback = rollback
        self.target = TargetModules.from_target(target)
        # EOS and max_length as the call's criteria say (a user's may stand for generate()'s own): a block cuts at
        # them itself (`stop_free_length`); the other criteria (stop strings, ...) must not fire inside it.
        stops = CallStops.of(stopping_criteria, generation_config, target.device)
        self.max_length, self.ends = stops.max_length, stops.ends
        self.block_stopping_criteria = stops.criteria + ends_the_loop_runs_past(stops.ends, generation_config)
        # Sampling, a drawn draft that completes a stop is offered and the block cut after it, which transformers'
        # loop cannot do: such calls run the batch loop, and here (one it refuses) no drawn draft is offered, only
        # copies, which follow from the text (`stop_free_length`).
        self.offers_draws = not (generation_config.do_sample and reads_the_tokens(self.block_stopping_criteria))
        self.max_drafts = options.drafts_per_block(drafter)
        self.do_sample = bool(generation_config.do_sample)
        # Greedy verification never reads the draft logits unless the ensemble option mixes them in.
        self.return_logits = self.do_sample or generation_config.assistant_ensemble_weight is not None
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        # The EOS ids the processors read are the config's (a length penalty's), whatever the criteria end at.
        self.vocab = drafting_vocab(
            drafter.draft_vocab if options.draft_vocab else None, self.logits_processor,
            getattr(generation_config, "_eos_token_tensor", None),
        )  # fmt: skip
        layers = hidden_state_indices(drafter.config.target_layer_ids)
        # A user asking for all hidden states in the output needs them all from every forward.
        self.model_kwargs_overrides = {
            "output_hidden_states": True if generation_config.output_hidden_states else layers
        }
        self.rollout = self._select_rollout()
        self.context = DrafterContext()
        # A chunked prefill's leading chunks, read before the loop (`read_leading_chunks`): the loop's prefill reads
        # the last chunk, and the drafter's context starts with them.
        if leading_features is not None:
            self.context.append(leading_features.to(drafter.device))
        self.prefill_read = False  # whether the loop's prefill (its first forward) has been read as context
        self.policy: AdaptivePolicy | FixedPolicy | None = None  # built at the first drafting step (it measures)
        # Copied and retrieved drafts have no distribution to mix with the target's: the ensemble option turns them off.
        self.lookup = options.domino_lookup and generation_config.assistant_ensemble_weight is None
        # transformers' own prompt-lookup length, when a call sets it, caps the copies.
        self.max_copies = min(self.max_drafts, generation_config.prompt_lookup_num_tokens or self.max_drafts)
        self.datastore = checked_datastore(drafter) if self.lookup and options.domino_datastore else None
        self.lookup_policy: LookupPolicy | None = None
        self.datastore_policy: LookupPolicy | None = None
        # Copies (from the text or the datastore) declined this cycle, judged at the next call: (policy, sequence
        # length, copy).
        self.declined: list[tuple[LookupPolicy, int, torch.LongTensor]] = []
        self.stats = DominoGenerationStats(timings={} if options.domino_timings else None)
        drafter.last_generation_stats = self.stats
        self.cycle: dict[str, Any] = {"drafted": False, "verified": 0}  # what the policy learns from
        self.copy_policy: LookupPolicy | None = None  # the policy of this cycle's copies, when it verifies copies
        self._clock = time.perf_counter()

    # ---------------------------------------------------------------------------------------------- loop interface
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs: Any,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        # The first target forward is a plain prefill: there is no context to draft from yet.
        if is_first_iteration:
            self.cycle, self.copy_policy = {"drafted": False, "verified": 0}, None
            return input_ids, None
        verify_seconds = self._lap("verify", self.cycle["drafted"])
        model_kwargs = model_kwargs or {}
        if self.policy is None:
            self.policy, self.lookup_policy, self.datastore_policy = self._build_policies(input_ids, model_kwargs)
        elif self.cycle.get("catch_up"):
            pass  # a re-read, not a plain step: its cost would mislead the policy's plain-step price
        elif self.copy_policy is not None:
            self.copy_policy.observe(
                verified=self.cycle["verified"], accepted=int(n_last_matches), verify_seconds=verify_seconds
            )
        else:
            self.policy.observe(verify_seconds=verify_seconds, accepted=int(n_last_matches), **self.cycle)
        self.context.append(self._new_context_features(input_ids, model_kwargs, model_outputs, int(n_last_matches)))
        self._judge_declined_copies(input_ids)
        self.cycle, self.copy_policy = {"drafted": False, "verified": 0}, None
        if self.rollback is not None and self.rollback.lagging(input_ids.shape[1]):
            # The last verification was rolled back: this forward reads its verified tokens again and drafts nothing,
            # so that it is kept whole (drafts would risk another rollback, and the re-read would grow each time).
            self.cycle["catch_up"] = True
            self.stats.rereads += 1
            self._lap()
            return input_ids, None
        room = self.max_length - input_ids.shape[1] - 1  # the target adds one token of its own
        copied = self._copied_drafts(input_ids, min(self.max_copies, room))
        if copied is not None:
            self.cycle["verified"] = copied.shape[1]
            self._lap()
            logits = certain_logits(copied, self.drafter.config.vocab_size) if self.do_sample else None
            return torch.cat([input_ids, copied], dim=-1), logits
        num_drafts = self.policy.budget(min(self.max_drafts, room)) if self.offers_draws else 0
        if num_drafts <= 0:
            self._lap()
            return input_ids, None
        with torch.no_grad():
            drafts = self._draft(input_ids, num_drafts)
        keep = self.policy.choose(drafts.confidence, self.cycle["backbone_seconds"] + self.cycle["rollout_seconds"])
        drafts = self._truncate_at_stop(input_ids, drafts.keep(keep))
        self.cycle["verified"] = len(drafts)
        self._lap()
        if len(drafts) == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, drafts.ids.to(input_ids.device)], dim=-1)
        if not self.return_logits:
            return candidates, None
        logits, vocab_size = drafts.logits, self.drafter.config.vocab_size
        if logits.shape[-1] != vocab_size:  # greedy drafts keep a draft vocabulary's columns; the loop reads them all
            logits = spread_to_vocabulary(logits, self.vocab, vocab_size)
        return candidates, logits

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts one verification offers (transformers >= 5.25 reads it to size what a cache keeps for a
        rollback; this generator's recurrent targets roll back through `RecurrentRollback` instead)."""
        return self.max_drafts

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        # Every target forward after the prefill counts, plain steps included: the mean is then exactly generated
        # tokens per decoding forward.
        if self.policy is not None:
            self.stats.acceptance_lengths.append(int(num_matches) + 1)
            self.stats.drafted.append(self.cycle["verified"])
            self.stats.copied.append(self.copy_policy is self.lookup_policy)
            self.stats.retrieved.append(self.copy_policy is self.datastore_policy)

    # ------------------------------------------------------------------------------------------------------ steps
    def _draft(self, input_ids: torch.LongTensor, num_drafts: int) -> Drafts:
        """One block down the ladder: backbone, base logits of `num_drafts` positions, rollout."""
        hidden = run_backbone(self.drafter, self.target, input_ids, self.context, num_drafts)
        backbone = self._lap("backbone", True)
        block = BlockDraft.from_hidden(hidden, self.target, self.vocab)
        lm_head = self._lap("lm_head", True)
        drafts = self.rollout(block, input_ids)
        head = self._lap("head", True)
        self.cycle = {
            "drafted": True,
            "verified": 0,
            "positions": len(drafts),
            "backbone_seconds": backbone,
            "rollout_seconds": lm_head + head,
        }
        return drafts

    def _copied_drafts(self, input_ids: torch.LongTensor, limit: int) -> torch.LongTensor | None:
        """Drafts copied from the text (`lookup_drafts`), else retrieved from the datastore, as many as the source's
        policy verifies, cut before a stop; None when neither found drafts expected to beat the drafter (or a plain
        step). A source declined is judged against what is generated instead (next call)."""
        if not self.lookup:
            return None
        sources = [(lookup_drafts, self.lookup_policy)]
        if self.datastore is not None:
            sources.append((self.datastore.lookup, self.datastore_policy))
        rival = None
        for find, policy in sources:
            found = find(input_ids, limit)
            if found is None:
                continue
            if rival is None:
                rival = self.policy.rate_without_copies() if self.policy.adaptive else 0.0
            keep = policy.choose(found.shape[1], rival)
            if keep == 0:
                self.declined.append((policy, input_ids.shape[1], found[0]))
                continue
            found = found[:, :keep]
            keep = self._stop_free_length(input_ids, found)
            if keep:
                self.copy_policy = policy
                return found[:, :keep]
            return None
        return None

    def _judge_declined_copies(self, input_ids: torch.LongTensor) -> None:
        """The copies declined last cycle against the tokens generated since: what they would have earned."""
        for policy, length, declined in self.declined:
            offered, accepted = judge_copy(declined, input_ids[0, length:])
            policy.observe(verified=offered, accepted=accepted)
        self.declined = []

    def _new_context_features(
        self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any], model_outputs: Any, n_last_matches: int
    ) -> torch.Tensor:
        """Target features of the tokens verified since the last call, padding dropped, on the drafter's device."""
        hidden_states = getattr(model_outputs, "hidden_states", None)
        if hidden_states is None:
            raise ValueError(
                "The target returned no hidden_states although output_hidden_states was requested; a Domino drafter "
                "needs a target whose forward supports output_hidden_states."
            )
        # After the prefill every prompt token it read is new context (all of them, those after a cache the call
        # continues, from which the drafter then reads, or a chunked prefill's last chunk); later, the accepted drafts plus the previous anchor.
        first, self.prefill_read = not self.prefill_read, True
        features = context_features(hidden_states, self.drafter.config.target_layer_ids)
        if not first:  # the forward's last tokens: a target with recurrent layers may have read verified ones first
            return features[:, -(self.cycle["verified"] + 1) :][:, : n_last_matches + 1].to(self.drafter.device)
        check_context_features(features, self.drafter.config)
        features = features[:, : input_ids.shape[1] - 1]
        read = features.shape[1]
        self._check_prefill(read)
        # The mask covers any cached columns, the prompt and the first token picked: `read` columns before that.
        attention_mask = model_kwargs.get("attention_mask")
        mask = None if attention_mask is None else attention_mask[0, -read - 1 : -1]
        if mask is not None and not bool(mask.all()):
            features = features[:, mask.bool().to(features.device)]
        return features.to(self.drafter.device)

    def _check_prefill(self, read: int) -> None:
        """Raises when a call continuing a filled cache had its prefill read the cached tokens again (a target whose
        own `prepare_inputs_for_generation` skips transformers', which the hook corrects)."""
        if self.prefill_length is not None and read != self.prefill_length:
            raise RuntimeError(
                f"The target's prefill read {read} tokens where the cache passed to generate() left "
                f"{self.prefill_length} to read: {type(self.target_model).__name__}.prepare_inputs_for_generation "
                "does not call GenerationMixin's, so the cached tokens were read twice. Generate without the cache "
                "(pass the whole prompt), or without the drafter."
            )

    def _truncate_at_stop(self, input_ids: torch.LongTensor, drafts: Drafts) -> Drafts:
        """Keeps drafts only up to the one before a stopping criterion would fire, or up to an EOS (`stop_free_length`)."""
        return drafts.keep(self._stop_free_length(input_ids, drafts.ids))

    def _stop_free_length(self, input_ids: torch.LongTensor, draft_ids: torch.LongTensor) -> int:
        """How many of `draft_ids` `[1, k]` can be offered without one completing a stop, none after an EOS."""
        return stop_free_length(self.block_stopping_criteria, input_ids[0], draft_ids[0], ends=self.ends)

    # ------------------------------------------------------------------------------------------------------ set-up
    @property
    def _timing_is_free(self) -> bool:
        return timing_is_free(self.drafter.device)

    def _lap(self, name: str | None = None, record: bool = False) -> float:
        """Seconds since the previous lap; added to `timings[name]` when timings were asked for (the adaptive policy
        learns from them too: on CUDA the lap then waits for the device, `DominoOptions.reads_cycle_times`)."""
        settle_for_timing(self.drafter.device, self.options.reads_cycle_times)
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        if record and self.stats.timings is not None:
            self.stats.timings.setdefault(name, []).append(seconds)
        return seconds

    def _build_policies(
        self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any]
    ) -> tuple[AdaptivePolicy | FixedPolicy, LookupPolicy, LookupPolicy]:
        """The drafter's policy and those for copied and retrieved drafts, which share the target's verify-cost
        table; each source learns its own acceptance."""
        options, drafter = self.options, self.drafter
        lookup_record, datastore_record = copy_records(drafter, self.target_model, self.do_sample)
        if options.draft_policy == "fixed":
            policy = FixedPolicy(self.max_drafts, options.assistant_confidence_threshold)
            return policy, LookupPolicy(lookup_record, None), LookupPolicy(datastore_record, None)
        cache, target = model_kwargs.get(CACHE_ARGUMENT), self.target_model
        forward_kwargs = {"output_hidden_states": self.model_kwargs_overrides["output_hidden_states"]}

        def measure() -> VerifyCost:
            if isinstance(cache, DynamicCache) and not rolls_back(cache, target):  # on the call's own context
                return measure_verify_cost(target, cache, input_ids[:, -1:], forward_kwargs)  # given back each time
            # A static cache has no room to spare; recurrent states cannot give a measured block back.
            return measure_verify_cost_on_scratch(target, forward_kwargs)

        cost = verify_cost_for(target, measure)
        mode = DraftingMode(sampled=self.do_sample, head=options.head_enabled(drafter), vocab=self.vocab is not None)
        policy = AdaptivePolicy(
            drafter_record(drafter, target, mode, drafter.config.num_drafts),
            cost,
            cap=self.max_drafts,
            confidence_threshold=options.assistant_confidence_threshold,
            per_position=self._timing_is_free,
        )
        return policy, LookupPolicy(lookup_record, cost), LookupPolicy(datastore_record, cost)

    def _select_rollout(self) -> Rollout:
        """The fused Triton/CUDA-graph head rollout of `hf_domino.fused_head` when it applies, else the eager one."""
        drafter, options = self.drafter, self.options
        pick = greedy_pick
        if self.do_sample or self.logits_processor is not None:
            pick = processed_pick(self.logits_processor, self.do_sample, self.vocab, drafter.config.vocab_size)
        # The policy is built at the first drafting call, after this: the eager rollout asks it through a closure.
        keep_rolling = (
            (lambda confidence: self.policy.keep_rolling(confidence)) if options.draft_policy == "adaptive" else None
        )
        fused = select_fused_rollout(
            drafter,
            self.target,
            options,
            do_sample=self.do_sample,
            logits_processor=self.logits_processor,
            max_drafts=self.max_drafts,
        )
        if fused is not None:
            return fused
        # Processors that read tokens must not be shown drafts past an EOS: the rollout stops there (a check per
        # position); other drafts past one are cut after it (`_truncate_at_stop`).
        ends = None if score_only(self.logits_processor) else self.ends
        head = options.head_enabled(drafter)
        return eager_rollout(drafter, self.target, pick, head=head, keep_rolling=keep_rolling, ends=ends)


# ------------------------------------------------------------------------------------------------- chunked prefill
def read_leading_chunks(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    model_kwargs: dict[str, Any],
    generation_config: GenerationConfig,
    chunk_size: int,
    prefill_length: int | None,
    layer_ids: list[int],
) -> tuple[torch.Tensor | None, int | None]:
    """A chunked prefill (`prefill_chunk_size`) up to its last chunk, chunked as transformers' `_prefill` chunks the
    target alone's: the prompt's uncached tokens (`prefill_length` of them, None: all) split into chunks of
    `chunk_size`, each but the last read into the call's cache in turn, so that no forward reads more than a chunk.

    Returns the target features of the tokens read (padding dropped; None when the prompt fits one chunk) and how
    many tokens the loop's first forward has left to read (`prefill_length` for the generator): the last chunk,
    whose last logits pick the first token as the target alone's last chunk does.
    """
    to_read = input_ids[:, -prefill_length:] if prefill_length is not None else input_ids
    chunks = torch.split(to_read, chunk_size, dim=-1)
    if len(chunks) < 2:
        return None, prefill_length
    cache = model_kwargs[CACHE_ARGUMENT]
    attention_mask, position_ids = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    # Only the drafter's layers are kept: the call's outputs hold the last chunk's forward, as the target alone's do.
    sliced = ("attention_mask", "position_ids", "output_hidden_states", "output_attentions", "return_dict")
    kwargs = {name: value for name, value in model_kwargs.items() if name not in sliced}
    past, features = cached_tokens(cache), []
    # Compiled where transformers compiles the target alone's chunks (a static cache on CUDA, or as CompileConfig asks).
    forward = (
        target.get_compiled_call(generation_config.compile_config)
        if target._valid_auto_compile_criteria(model_kwargs, generation_config)
        else target.__call__
    )
    for chunk in chunks[:-1]:
        end = past + chunk.shape[1]
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask[:, :end]
        if position_ids is not None:
            kwargs["position_ids"] = position_ids[..., past:end]
        if model_kwargs.get("token_type_ids") is not None:  # up to the chunk's end, as the mask
            kwargs["token_type_ids"] = model_kwargs["token_type_ids"][..., :end]
        inputs = target.prepare_inputs_for_generation(chunk, is_first_iteration=True, **kwargs)
        with torch.no_grad():
            outputs = forward(**inputs, output_hidden_states=hidden_state_indices(layer_ids), return_dict=True)
        read = context_features(outputs.hidden_states, layer_ids)
        if attention_mask is not None and not bool(attention_mask[0, past:end].all()):
            read = read[:, attention_mask[0, past:end].bool().to(read.device)]
        features.append(read)
        past = end
    return torch.cat(features, dim=1), chunks[-1].shape[1]
