"""Domino drafting inside transformers' own assisted-decoding loop.

`target.generate(..., assistant_model=drafter)` with a `DominoForSpeculation` drafter must pick our candidate
generator, but transformers 5.x has no public way to plug one in. `install_assisted_generation_hook()` wraps five
`GenerationMixin` methods; each wrapper hands over to the original unchanged unless the assistant is a Domino drafter:

- `_extract_generation_mode_kwargs`: takes this call's Domino options (`DominoOptions`) out of generate()'s kwargs;
- `_validate_generation_mode`: validates them and the drafter/target pair, once, before any generation work;
- `_assisted_decoding`: remembers the call's options and stopping criteria for the generator, and how much of the
  prompt the prefill reads when the call continues a filled cache (`uncached_prompt_length`), and runs the loop with
  the call's attention kernels (`drafting_attention_kernels`);
- `prepare_inputs_for_generation`: makes the loop's prefill read only that much, as the target alone's does
  (transformers' assisted loop reads the cached tokens again);
- `_get_candidate_generator`: returns `drafter.build_candidate_generator(...)`.

`DominoCandidateGenerator` is a thin adapter between transformers' `CandidateGenerator` interface and the drafting
ladder of `drafting_domino` (what to draft) and the policy of `policy_domino` (how many drafts to verify).

The hook is installed when a drafter is built (see `DominoForSpeculation.__init__`) or `hf_domino` is imported; it
is idempotent, and refuses to install on a transformers whose methods no longer have the parameters it relies on.
This file is also written next to exported checkpoints as remote code, so it imports only transformers and torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import transformers
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .batching_domino import batched_assisted_decoding
from .cache_domino import CACHE_ARGUMENT, buffer_layers, uncached_prompt_length
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
    DrafterContext,
    Drafts,
    eager_rollout,
    greedy_pick,
    judge_copy,
    lookup_drafts,
    processed_pick,
    run_backbone,
    select_fused_rollout,
    stop_free_length,
)
from .modeling_domino import TargetModules, context_features, hidden_state_indices
from .options_domino import DominoGenerationStats, DominoOptions, check_drafter_for_target
from .policy_domino import AdaptivePolicy, FixedPolicy, LookupPolicy, copy_records, drafter_record

if TYPE_CHECKING:
    from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

    from .drafting_domino import Rollout
    from .modeling_domino import DominoForSpeculation


# ------------------------------------------------------------------------------------------------ candidate generator
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
        self.target = TargetModules.from_target(target)
        self.max_length = generation_config.max_length
        self.max_drafts = options.drafts_per_block(drafter)
        self.vocab = drafter.draft_vocab if options.draft_vocab else None
        self.do_sample = bool(generation_config.do_sample)
        # Greedy verification never reads the draft logits unless the ensemble option mixes them in.
        self.return_logits = self.do_sample or generation_config.assistant_ensemble_weight is not None
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        # EOS and max length are already cut inside a block by the loop; other criteria (stop strings, ...) are not.
        self.block_stopping_criteria = [
            criterion
            for criterion in (stopping_criteria or [])
            if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria))
        ]
        layers = hidden_state_indices(drafter.config.target_layer_ids)
        # A user asking for all hidden states in the output needs them all from every forward.
        self.model_kwargs_overrides = {
            "output_hidden_states": True if generation_config.output_hidden_states else layers
        }
        self.rollout = self._select_rollout()
        self.context = DrafterContext()
        self.policy: AdaptivePolicy | FixedPolicy | None = None  # built at the first drafting step (it measures)
        # Copied and retrieved drafts have no distribution to mix with the target's: the ensemble option turns them off.
        self.lookup = options.domino_lookup and generation_config.assistant_ensemble_weight is None
        # transformers' own prompt-lookup length, when a call sets it, caps the copies.
        self.max_copies = min(self.max_drafts, generation_config.prompt_lookup_num_tokens or self.max_drafts)
        self.datastore = drafter.datastore if self.lookup and options.domino_datastore else None
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
        elif self.copy_policy is not None:
            self.copy_policy.observe(
                verified=self.cycle["verified"], accepted=int(n_last_matches), verify_seconds=verify_seconds
            )
        else:
            self.policy.observe(verify_seconds=verify_seconds, accepted=int(n_last_matches), **self.cycle)
        self.context.append(self._new_context_features(input_ids, model_kwargs, model_outputs, int(n_last_matches)))
        self._judge_declined_copies(input_ids)
        self.cycle, self.copy_policy = {"drafted": False, "verified": 0}, None
        room = self.max_length - input_ids.shape[1] - 1  # the target adds one token of its own
        copied = self._copied_drafts(input_ids, min(self.max_copies, room))
        if copied is not None:
            self.cycle["verified"] = copied.shape[1]
            self._lap()
            return torch.cat([input_ids, copied], dim=-1), None
        num_drafts = self.policy.budget(min(self.max_drafts, room))
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
        return candidates, drafts.logits if self.return_logits else None

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
        # After the prefill every prompt token it read is new context (all of them, or those after a cache the call
        # continues: the drafter then reads from there); later, the accepted drafts plus the previous anchor.
        first = self.context.num_tokens == 0
        num_new = input_ids.shape[1] - 1 if first else n_last_matches + 1
        features = context_features(hidden_states, self.drafter.config.target_layer_ids)[:, :num_new]
        if first:
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
        """Keeps drafts only up to the one before a stopping criterion would fire (`stop_free_length`)."""
        return drafts.keep(self._stop_free_length(input_ids, drafts.ids))

    def _stop_free_length(self, input_ids: torch.LongTensor, draft_ids: torch.LongTensor) -> int:
        """How many of `draft_ids` `[1, k]` can be offered without one completing a stop."""
        return stop_free_length(self.block_stopping_criteria, input_ids[0], draft_ids[0])

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
        sampling = "sample" if self.do_sample else "greedy"
        lookup_record, datastore_record = copy_records(drafter, self.do_sample)
        if options.draft_policy == "fixed":
            policy = FixedPolicy(self.max_drafts, options.assistant_confidence_threshold)
            return policy, LookupPolicy(lookup_record, None), LookupPolicy(datastore_record, None)
        cache, target = model_kwargs.get(CACHE_ARGUMENT), self.target_model
        forward_kwargs = {"output_hidden_states": self.model_kwargs_overrides["output_hidden_states"]}

        def measure() -> VerifyCost:
            if isinstance(cache, DynamicCache):  # on the call's own context, given back after each forward
                return measure_verify_cost(target, cache, input_ids[:, -1:], forward_kwargs)
            return measure_verify_cost_on_scratch(target, forward_kwargs)  # a static cache has no room to spare

        cost = verify_cost_for(target, measure)
        mode = sampling + ("+head" if options.head_enabled(drafter) else "")
        mode += "+vocab" if self.vocab is not None else ""
        policy = AdaptivePolicy(
            drafter_record(drafter, mode, drafter.config.num_drafts),
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
        return eager_rollout(drafter, self.target, pick, head=options.head_enabled(drafter), keep_rolling=keep_rolling)


# -------------------------------------------------------------------------------------------------- generate() hook
class _DominoCall(NamedTuple):
    """What `_assisted_decoding` knows of a batch-1 call that the candidate generator and the prefill need."""

    options: DominoOptions
    stopping_criteria: StoppingCriteriaList | None
    prefill_length: int | None  # `uncached_prompt_length`: None when the prefill reads the whole prompt


_CALL: contextvars.ContextVar[_DominoCall | None] = contextvars.ContextVar("domino_call", default=None)
# The parameters each wrapped method must still have for the hook to be correct.
_REQUIRED_PARAMETERS = {
    "_extract_generation_mode_kwargs": ("kwargs", "assistant_model"),
    "_validate_generation_mode": ("generation_mode", "generation_config", "generation_mode_kwargs"),
    "_assisted_decoding": (
        "input_ids",
        "logits_processor",
        "stopping_criteria",
        "generation_config",
        "assistant_model",
    ),
    "_get_candidate_generator": (
        "generation_config",
        "input_ids",
        "logits_processor",
        "model_kwargs",
        "assistant_model",
    ),
    "prepare_inputs_for_generation": ("input_ids", "next_sequence_length", "is_first_iteration"),
}
# Where the options travel from `_extract_generation_mode_kwargs` to `_assisted_decoding`, and whether the call
# passed an attention mask (a padded batch without one is refused).
_OPTIONS_KEY = "domino_options"
_MASK_GIVEN_KEY = "domino_attention_mask_given"


def is_domino_drafter(model: Any) -> bool:
    return bool(getattr(model, "_is_domino_drafter", False))


def _bound_arguments(method, self, args, kwargs) -> dict[str, Any]:
    return inspect.signature(method).bind(self, *args, **kwargs).arguments


def _wrap_extract_generation_mode_kwargs(original):
    @functools.wraps(original)
    def _extract_generation_mode_kwargs(self, *args, **kwargs):
        arguments = _bound_arguments(original, self, args, kwargs)
        mode_kwargs = original(self, *args, **kwargs)
        if is_domino_drafter(arguments.get("assistant_model")):
            # generate()'s own kwargs dict: what we pop here never reaches the model as an unknown model kwarg.
            call_kwargs = arguments["kwargs"]
            mode_kwargs[_OPTIONS_KEY] = {
                name: call_kwargs.pop(name) for name in DominoOptions.names() if name in call_kwargs
            }
            mode_kwargs[_MASK_GIVEN_KEY] = call_kwargs.get("attention_mask") is not None
        return mode_kwargs

    return _extract_generation_mode_kwargs


def _single_sequence_view(generation_config: GenerationConfig) -> GenerationConfig:
    """A copy with num_return_sequences=1, for transformers' own checks of an assisted call."""
    view = copy.copy(generation_config)
    view.num_return_sequences = 1
    return view


def _wrap_validate_generation_mode(original):
    @functools.wraps(original)
    def _validate_generation_mode(self, *args, **kwargs):
        arguments = _bound_arguments(original, self, args, kwargs)
        mode_kwargs = arguments.get("generation_mode_kwargs") or {}
        assistant = mode_kwargs.get("assistant_model")
        if is_domino_drafter(assistant):
            check_drafter_for_target(assistant, self, arguments["generation_config"])
            options = DominoOptions.resolve(mode_kwargs.get(_OPTIONS_KEY, {}), arguments["generation_config"])
            options.validate(assistant)
            mode_kwargs[_OPTIONS_KEY] = options  # validated once; the generator takes it as is
            if arguments["generation_config"].num_return_sequences > 1:
                # transformers refuses several sequences per prompt for an assistant; ours serves them as a batch.
                bound = inspect.signature(original).bind(self, *args, **kwargs)
                bound.arguments["generation_config"] = _single_sequence_view(arguments["generation_config"])
                return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    return _validate_generation_mode


def cudnn_attention_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether scaled_dot_product_attention may pick cuDNN's kernels for tensors on `device` in `dtype` now: CUDA,
    half precision, and the process's cuDNN switch on (a drafting call turns it off while it runs)."""
    return (
        device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and torch.backends.cuda.cudnn_sdp_enabled()
    )


def drafting_attention_kernels(
    device: torch.device, dtype: torch.dtype, allow_cudnn: bool = False
) -> contextlib.AbstractContextManager:
    """The scaled_dot_product_attention kernels a drafting call runs with: on CUDA in float16/bfloat16, every enabled
    kernel but cuDNN's; elsewhere, or with `allow_cudnn`, the process's own choice.

    PyTorch builds with a cuDNN newer than 9.15 (its CUDA 13 wheels) try cuDNN's attention first on Hopper and
    Blackwell GPUs, and cuDNN builds an execution plan for each new shape (query length, key length) before it runs
    it, which costs milliseconds where the kernel costs microseconds. Plain decoding meets each key length once per
    call and the next call finds most of them planned, but a drafting call verifies a new (drafts, context) pair at
    every cycle and the drafter attends from its block to a new context length, so each cycle pays for new plans.
    """
    if allow_cudnn or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return contextlib.nullcontext()
    return _cudnn_attention_off()


# cuDNN's SDPA switch is process-wide: calls that overlap (threads serving requests, a streamer's generation thread)
# share one "off", and the last one to finish puts back what the first one found.
_CUDNN_SWITCH_LOCK = threading.Lock()
_calls_without_cudnn = 0
_cudnn_switch_found = True


@contextlib.contextmanager
def _cudnn_attention_off():
    global _calls_without_cudnn, _cudnn_switch_found
    with _CUDNN_SWITCH_LOCK:
        if _calls_without_cudnn == 0:
            _cudnn_switch_found = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _calls_without_cudnn += 1
    try:
        yield
    finally:
        with _CUDNN_SWITCH_LOCK:
            _calls_without_cudnn -= 1
            if _calls_without_cudnn == 0:
                torch.backends.cuda.enable_cudnn_sdp(_cudnn_switch_found)


def _wrap_assisted_decoding(original):
    @functools.wraps(original)
    def _assisted_decoding(self, *args, **kwargs):
        options = kwargs.pop(_OPTIONS_KEY, None)
        attention_mask_given = kwargs.pop(_MASK_GIVEN_KEY, True)
        arguments = _bound_arguments(original, self, args, kwargs)
        drafter = arguments.get("assistant_model")
        if not is_domino_drafter(drafter):
            return original(self, *args, **kwargs)
        if not isinstance(options, DominoOptions):  # reached without generate()'s validation
            options = DominoOptions.resolve(options or {}, arguments["generation_config"])
            options.validate(drafter)
        kernels = drafting_attention_kernels(self.device, self.dtype, options.domino_cudnn_attention)
        if arguments["input_ids"].shape[0] > 1:  # transformers' loop verifies one sequence: a batch is ours
            stats = DominoGenerationStats(timings={} if options.domino_timings else None)
            drafter.last_generation_stats = stats
            with kernels:
                return batched_assisted_decoding(
                    self,
                    arguments["input_ids"],
                    arguments["logits_processor"],
                    arguments["stopping_criteria"],
                    arguments["generation_config"],
                    drafter,
                    options,
                    stats,
                    streamer=arguments.get("streamer"),
                    attention_mask_given=attention_mask_given,
                    **arguments.get("model_kwargs", {}),
                )
        model_kwargs, generation_config = arguments.get("model_kwargs", {}), arguments["generation_config"]
        cache = model_kwargs.get(CACHE_ARGUMENT)
        prefill_length = uncached_prompt_length(
            cache, arguments["input_ids"], model_kwargs.get("attention_mask"), generation_config
        )
        if isinstance(cache, DynamicCache):  # verified blocks written in place, not concatenated (BufferedLayer)
            buffer_layers(cache, options.cache_columns(drafter, generation_config.max_length))
        token = _CALL.set(_DominoCall(options, arguments.get("stopping_criteria"), prefill_length))
        try:
            with kernels:
                return original(self, *args, **kwargs)
        finally:
            _CALL.reset(token)

    return _assisted_decoding


def _wrap_get_candidate_generator(original):
    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        arguments = _bound_arguments(original, self, args, kwargs)
        assistant = arguments.get("assistant_model")
        if not is_domino_drafter(assistant):
            return original(self, *args, **kwargs)
        call = _CALL.get() or _DominoCall(None, None, None)
        return assistant.build_candidate_generator(
            target=self,
            generation_config=arguments["generation_config"],
            logits_processor=arguments["logits_processor"],
            input_ids=arguments["input_ids"],
            stopping_criteria=call.stopping_criteria,
            options=call.options,
            prefill_length=call.prefill_length,
        )

    return _get_candidate_generator


def _wrap_prepare_inputs_for_generation(original):
    @functools.wraps(original)
    def prepare_inputs_for_generation(self, *args, **kwargs):
        # transformers' assisted loop asks its first forward (the prefill) for the whole prompt, also when the call
        # continues a filled cache: inside a Domino call, read only what the cache does not hold, as `_prefill` does.
        call = _CALL.get()
        if (
            call is not None
            and call.prefill_length is not None
            and kwargs.get("is_first_iteration")
            and kwargs.get("next_sequence_length") is None
        ):
            kwargs["next_sequence_length"] = call.prefill_length
        return original(self, *args, **kwargs)

    return prepare_inputs_for_generation


_WRAPPERS = {
    "_extract_generation_mode_kwargs": _wrap_extract_generation_mode_kwargs,
    "_validate_generation_mode": _wrap_validate_generation_mode,
    "_assisted_decoding": _wrap_assisted_decoding,
    "_get_candidate_generator": _wrap_get_candidate_generator,
    "prepare_inputs_for_generation": _wrap_prepare_inputs_for_generation,
}


def install_assisted_generation_hook() -> None:
    """Lets `generate(assistant_model=<Domino drafter>)` use `DominoCandidateGenerator`; other calls are untouched."""
    for name, wrap in _WRAPPERS.items():
        current = getattr(GenerationMixin, name, None)
        if getattr(current, "__domino_hook__", False):
            continue  # already installed (by this module or by another copy of it, e.g. remote code)
        parameters = inspect.signature(current).parameters if current is not None else {}
        missing = [p for p in _REQUIRED_PARAMETERS[name] if p not in parameters]
        if current is None or missing or not hasattr(CandidateGenerator, "requires_model_outputs"):
            raise ImportError(
                f"Domino's generate() integration relies on transformers' GenerationMixin.{name} "
                f"(parameters {list(_REQUIRED_PARAMETERS[name])}) and CandidateGenerator.requires_model_outputs, "
                f"which transformers {transformers.__version__} changed. Install transformers>=5.23,<6."
            )
        wrapper = wrap(current)
        wrapper.__domino_hook__ = True
        setattr(GenerationMixin, name, wrapper)
