"""The generate() hook: how `target.generate(..., assistant_model=drafter)` reaches Domino drafting.

`target.generate(..., assistant_model=drafter)` with a `DominoForSpeculation` drafter must pick our candidate
generator (`generation_domino.DominoCandidateGenerator`), but transformers 5.x has no public way to plug one in.
`install_assisted_generation_hook()` wraps nine `GenerationMixin` methods; each wrapper hands over to the original
unchanged unless the assistant is a Domino drafter this copy of the code built (see the end of this docstring):

- `_extract_generation_mode_kwargs`: takes this call's Domino options (`DominoOptions`) out of generate()'s kwargs;
- `_validate_generation_mode`: validates them and the drafter/target pair, once, before any generation work;
- `_assisted_decoding`: remembers the call's options and stopping criteria for the generator, and how much of the
  prompt the prefill reads when the call continues a filled cache (`uncached_prompt_length`) or reads the prompt in
  chunks (`prefill_chunk_size`: it reads all but the last chunk itself, `read_leading_chunks`), hands a batch to
  `batching_domino`, and runs either loop with the call's attention kernels (`drafting_attention_kernels`);
- `prepare_inputs_for_generation`: makes the loop's prefill read only that much, as the target alone's does
  (transformers' assisted loop reads the cached tokens again);
- `_get_candidate_generator`: returns `drafter.build_candidate_generator(...)`;
- `generate_batch` (continuous batching, which drops an assistant model): serves the requests with the drafter in a
  batch that takes on waiting requests as rows finish (`continuous_batching_domino`);
- `init_continuous_batching` and `continuous_batching_context_manager` (the manager beneath it, which takes no
  assistant): with `assistant_model=` a Domino drafter, a `DraftedBatchingManager` that serves requests added from
  any thread the same way (`batching_manager_domino`);
- `generate` itself: for a target given a drafter by `attach_drafter`, passes `assistant_model=` that drafter where a
  call names no assistant of its own (what code that calls `generate()` without an assistant needs: `transformers
  serve`, evaluation harnesses), the other entry points above doing the same.

The hook is installed when a drafter is built (see `DominoForSpeculation.__init__`) or `hf_domino` is imported; it
is idempotent, and refuses to install on a transformers whose methods no longer have the parameters it relies on.
Each copy of this code in a process (the package, each drafter folder's remote code, maybe of other releases)
installs a layer of its own, which serves only the drafters that copy built: a drafter drafts with its own code.
This file is also written next to exported checkpoints as remote code, so it imports only transformers and torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import transformers
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils import logging

from .attached_drafter_domino import (
    ATTACHED_CALL,
    DrafterDeclined,
    PlainLoopStreamer,
    attachment,
    drafter_code,
    is_domino_drafter,
    wants_the_attached_drafter,
)
from .attention_kernels_domino import drafting_attention_kernels
from .batch_call_domino import check_batch_call
from .batch_generate_domino import batched_assisted_decoding
from .batching_manager_domino import DraftedBatchingManager
from .cache_domino import CACHE_ARGUMENT, buffer_layers, check_croppable, uncached_prompt_length
from .continuous_batching_domino import generate_requests
from .drafting_domino import CallStops, criteria_scores_withheld, reads_the_tokens
from .generation_domino import ends_the_loop_runs_past, read_leading_chunks
from .options_domino import (
    DominoGenerationStats,
    DominoOptions,
    check_drafter_for_target,
    check_synced_gpus,
    prefill_chunk_size,
    refuse_a_drafter_built_as_another_model,
    warn_of_other_assistant_settings,
)
from .recurrent_cache_domino import (
    RecurrentRollback,
    check_recurrent_call,
    has_recurrent_layers,
    keeps_recurrent_states,
    recurrent_state_check_waived,
)
from .target_modules_domino import target_execution_device
from .warpers_domino import sort_free_top_p

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel


logger = logging.get_logger(__name__)


class _DominoCall(NamedTuple):
    """What `_assisted_decoding` knows of a batch-1 call that the candidate generator and the prefill need."""

    options: DominoOptions
    stopping_criteria: StoppingCriteriaList | None
    prefill_length: int | None  # `uncached_prompt_length`: None when the prefill reads the whole prompt
    rollback: RecurrentRollback | None = None  # a target with recurrent layers: what each forward reads
    leading_features: torch.Tensor | None = None  # a chunked prefill's leading chunks (`read_leading_chunks`)


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
    "generate_batch": (
        "inputs",
        "generation_config",
        "continuous_batching_config",
        "record_timestamps",
        "progress_bar",
        "persistent_manager",
        "warmup",
        "kwargs",
    ),
    "init_continuous_batching": ("generation_config", "continuous_batching_config"),
    "continuous_batching_context_manager": ("generation_config", "block", "timeout", "continuous_batching_config"),
    "generate": ("generation_config", "assistant_model", "streamer", "custom_generate", "kwargs"),
}
# Where the options travel from `_extract_generation_mode_kwargs` to `_assisted_decoding`, whether the call passed an
# attention mask (a padded batch without one is refused), and whether it passed a cache (which the caller then sees
# after the call, so a batch leaves it as the target alone does).
_OPTIONS_KEY = "domino_options"
_MASK_GIVEN_KEY = "domino_attention_mask_given"
_CACHE_GIVEN_KEY = "domino_cache_given"


@functools.cache
def _signature(method) -> inspect.Signature:
    # Computed once per wrapped method: the wrappers run in every generate() call, with a drafter or not.
    return inspect.signature(method)


def _bound_arguments(method, self, args, kwargs) -> dict[str, Any]:
    return _signature(method).bind(self, *args, **kwargs).arguments


# -------------------------------------------------------------------------------------------- one layer per copy
# A process can hold several copies of this code: the package and the remote code of each drafter folder loaded with
# trust_remote_code, maybe of other releases. Each copy installs a layer of wrappers, and a layer drafts only with
# the drafters its own copy built, calling transformers' method beneath every layer: a drafter always drafts with its
# own code, and what a call keeps between wrappers (`_CALL`, `ATTACHED_CALL`, the options' keys) is one copy's.
_CODE = __name__.rpartition(".")[0]  # "hf_domino", or a checkpoint's remote-code package
_THIS_MODULE = __name__.rpartition(".")[2]


def _is_hook(method) -> bool:
    return bool(getattr(method, "__domino_hook__", False))


def _beneath_hooks(method):
    """transformers' own method under every copy's layer: what a layer that serves a call calls."""
    while _is_hook(method):
        method = method.__wrapped__
    return method


def _serves(model: Any, original) -> bool:
    """Whether this copy's wrapper of `original` drafts with `model`: a drafter this copy built; or one of a copy
    whose hook predates layers per copy (such a hook wraps every drafter, and installs nothing over another hook)
    when no hook lies beneath this one, as before."""
    code = drafter_code(model)
    if code is None:
        return False
    if code == _CODE:
        return True
    if hasattr(sys.modules.get(f"{code}.{_THIS_MODULE}"), "_CODE"):  # a copy with a layer of its own
        return False
    return not _is_hook(original)


def _refuse_compiled_wrapper(model: Any) -> None:
    """`torch.compile(drafter)` is a wrapper of another class, which transformers took for an assistant of its own
    and failed on (`no attribute 'generation_config'`)."""
    inner = getattr(model, "_orig_mod", None)
    if inner is not None and drafter_code(inner) is not None:
        raise TypeError(
            "assistant_model is torch.compile(drafter), a wrapper generate() cannot draft with: pass the drafter "
            "itself, compiled in place if it should be (drafter.compile())."
        )


def _wrap_extract_generation_mode_kwargs(original):
    unwrapped = _beneath_hooks(original)  # what this layer calls where it serves the call

    @functools.wraps(original)
    def _extract_generation_mode_kwargs(self, *args, **kwargs):
        arguments = _bound_arguments(original, self, args, kwargs)
        _refuse_compiled_wrapper(arguments.get("assistant_model"))
        if not _serves(arguments.get("assistant_model"), original):
            return original(self, *args, **kwargs)
        mode_kwargs = unwrapped(self, *args, **kwargs)
        # generate()'s own kwargs dict: what we pop here never reaches the model as an unknown model kwarg.
        call_kwargs = arguments["kwargs"]
        warn_of_other_assistant_settings(call_kwargs)
        mode_kwargs[_OPTIONS_KEY] = {
            name: call_kwargs.pop(name) for name in DominoOptions.names() if name in call_kwargs
        }
        mode_kwargs[_MASK_GIVEN_KEY] = call_kwargs.get("attention_mask") is not None
        # Either name: transformers 5.24+ still takes the old one (`CACHE_ARGUMENT`).
        mode_kwargs[_CACHE_GIVEN_KEY] = any(call_kwargs.get(name) is not None for name in ("cache", "past_key_values"))
        return mode_kwargs

    return _extract_generation_mode_kwargs


def _single_sequence_view(generation_config: GenerationConfig) -> GenerationConfig:
    """A copy with num_return_sequences=1, for transformers' own checks of an assisted call."""
    view = copy.copy(generation_config)
    view.num_return_sequences = 1
    return view


def _wrap_validate_generation_mode(original):
    unwrapped = _beneath_hooks(original)  # what this layer calls where it serves the call

    @functools.wraps(original)
    def _validate_generation_mode(self, *args, **kwargs):
        arguments = _bound_arguments(original, self, args, kwargs)
        mode_kwargs = arguments.get("generation_mode_kwargs") or {}
        assistant = mode_kwargs.get("assistant_model")
        if _serves(assistant, original):
            try:
                check_drafter_for_target(assistant, self, arguments["generation_config"])
                check_synced_gpus(mode_kwargs.get("synced_gpus", False))
                options = DominoOptions.resolve(mode_kwargs.get(_OPTIONS_KEY, {}), arguments["generation_config"])
                options.validate(assistant)
                mode_kwargs[_OPTIONS_KEY] = options  # validated once; the generator takes it as is
                bound = _signature(original).bind(self, *args, **kwargs)
                if arguments["generation_config"].num_return_sequences > 1:
                    # transformers refuses several sequences per prompt for an assistant; ours serves them as a batch.
                    bound.arguments["generation_config"] = _single_sequence_view(arguments["generation_config"])
                with recurrent_state_check_waived(self):
                    return unwrapped(*bound.args, **bound.kwargs)
            except ValueError as error:
                # The attached call on this target did not ask for the drafter: the target alone serves it. (A call
                # nested in it, by a stopping criterion or a streamer, did ask for what it names.)
                if ATTACHED_CALL.get() is self:
                    raise DrafterDeclined(str(error)) from error
                raise
        elif assistant is not None and not is_domino_drafter(assistant):  # another copy's drafter: its layer's
            refuse_a_drafter_built_as_another_model(assistant)
        return original(self, *args, **kwargs)

    return _validate_generation_mode


def _steps_returned_otherwise(generation_config: GenerationConfig, cache: Any, reads_part: bool) -> bool:
    """Whether transformers' assisted loop would return one sequence's per-step outputs otherwise than the target
    alone, so that the batch loop returns them instead: it splits its first step's hidden states as if the prefill
    read the whole prompt (one that `reads_part` of it: after a filled cache, or its last chunk), and hands a sliding
    layer's attention weights over every key its verifying cache keeps, more than the target alone's holds."""
    if generation_config.output_hidden_states and reads_part:
        return True
    return bool(
        generation_config.return_dict_in_generate and generation_config.output_attentions and cache is not None
        and any(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)
    )  # fmt: skip


def _asks_criteria_inside_blocks(stops: CallStops, generation_config: GenerationConfig) -> bool:
    """Whether one sequence's blocks must ask stopping criteria that read the tokens at each draft in transformers'
    loop: stop strings, a user's criteria, or a user's EOS ids that the loop does not cut a block at."""
    return reads_the_tokens(stops.criteria + ends_the_loop_runs_past(stops.ends, generation_config))


def _batch_loop_serves(target: PreTrainedModel, arguments: dict, options: DominoOptions, mask_given: bool) -> bool:
    """Whether the batch loop takes this one-sequence call: its checks pass (`check_batch_call`, and a recurrent
    target's for a batch)."""
    model_kwargs, generation_config = arguments.get("model_kwargs", {}), arguments["generation_config"]
    cache = model_kwargs.get(CACHE_ARGUMENT)
    try:
        check_batch_call(
            target, arguments["input_ids"], model_kwargs.get("attention_mask"), arguments["logits_processor"],
            generation_config, mask_given, options, model_kwargs,
        )  # fmt: skip
        if keeps_recurrent_states(target) or has_recurrent_layers(cache):
            check_recurrent_call(target, cache, generation_config, True, options.domino_branches)
    except ValueError:
        return False
    return True


def _wrap_assisted_decoding(original):
    unwrapped = _beneath_hooks(original)  # what this layer calls where it serves the call

    @functools.wraps(original)
    def _assisted_decoding(self, *args, **kwargs):
        drafter = _bound_arguments(original, self, args, kwargs).get("assistant_model")
        if not _serves(drafter, original):
            return original(self, *args, **kwargs)
        options = kwargs.pop(_OPTIONS_KEY, None)
        attention_mask_given = kwargs.pop(_MASK_GIVEN_KEY, True)
        cache_given = kwargs.pop(_CACHE_GIVEN_KEY, True)
        arguments = _bound_arguments(original, self, args, kwargs)
        if not isinstance(options, DominoOptions):  # reached without generate()'s validation
            options = DominoOptions.resolve(options or {}, arguments["generation_config"])
            options.validate(drafter)
        # The warpers of this call's list (which transformers' loop and the drafting both read), outputs unchanged.
        sort_free_top_p(arguments["logits_processor"])
        kernels = drafting_attention_kernels(target_execution_device(self), self.dtype, options.domino_cudnn_attention)
        # transformers' loop verifies one sequence: a batch is ours, and so is a tree of branches. So is a target whose
        # first weights accelerate offloaded: transformers' loop moves each block to `target.device`, the meta device.
        batched = arguments["input_ids"].shape[0] > 1 or options.domino_branches > 1 or self.device.type == "meta"
        model_kwargs, generation_config = arguments.get("model_kwargs", {}), arguments["generation_config"]
        stops = CallStops.of(arguments.get("stopping_criteria"), generation_config, target_execution_device(self))
        # Drawn drafts offer the one that completes a stop, which transformers' loop cannot cut after
        # (`stop_free_length`): the batch loop takes such a call where it serves it (else the generator draws none).
        if not batched and generation_config.do_sample and _asks_criteria_inside_blocks(stops, generation_config):
            batched = _batch_loop_serves(self, arguments, options, attention_mask_given)
        cache = model_kwargs.get(CACHE_ARGUMENT)
        prefill_length = chunk_size = None
        if not batched:
            prefill_length = uncached_prompt_length(
                cache, arguments["input_ids"], model_kwargs.get("attention_mask"), generation_config
            )
            chunk_size = None if cache is None else prefill_chunk_size(generation_config, model_kwargs)
            reads = prefill_length or arguments["input_ids"].shape[1]
            reads_part = prefill_length is not None or (chunk_size is not None and reads > chunk_size)
            batched = _steps_returned_otherwise(generation_config, cache, reads_part)
        # transformers rolls convolution-only layers back itself; recurrent states are ours to roll back.
        recurrent = keeps_recurrent_states(self)
        check_croppable(self, cache, batched)
        if recurrent or (batched and has_recurrent_layers(cache)):
            check_recurrent_call(self, cache, generation_config, batched, options.domino_branches)
        if batched:
            stats = DominoGenerationStats(timings={} if options.domino_timings else None)
            drafter.last_generation_stats = stats
            with kernels, criteria_scores_withheld(generation_config):
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
                    cache_given=cache_given,
                    **arguments.get("model_kwargs", {}),
                )
        # transformers' loop cuts an accepted block at its config's max_length: where a user's MaxLengthCriteria
        # reaches past it (this config is the call's copy), the loop would stop growing there and never end.
        generation_config.max_length = stops.max_length
        if isinstance(cache, DynamicCache):  # verified blocks written in place, not concatenated (BufferedLayer)
            buffer_layers(cache, options.cache_columns(drafter, generation_config.max_length))
        leading = None
        if chunk_size is not None:  # all but the last chunk, which the loop's prefill reads
            leading, prefill_length = read_leading_chunks(
                self, arguments["input_ids"], model_kwargs, generation_config, chunk_size, prefill_length,
                drafter.config.target_layer_ids,
            )  # fmt: skip
        rollback = None
        if recurrent:
            cached = arguments["input_ids"].shape[1] - (prefill_length or arguments["input_ids"].shape[1])
            rollback = RecurrentRollback.install(cache, committed=cached, target=self)
        call = _DominoCall(options, arguments.get("stopping_criteria"), prefill_length, rollback, leading)
        token = _CALL.set(call)
        try:
            with kernels, criteria_scores_withheld(generation_config):
                return unwrapped(self, *args, **kwargs)
        finally:
            _CALL.reset(token)
            if rollback is not None:
                rollback.remove()

    return _assisted_decoding


def _wrap_get_candidate_generator(original):
    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        arguments = _bound_arguments(original, self, args, kwargs)
        assistant = arguments.get("assistant_model")
        if not _serves(assistant, original):
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
            rollback=call.rollback,
            leading_features=call.leading_features,
        )

    return _get_candidate_generator


def _wrap_prepare_inputs_for_generation(original):
    unwrapped = _beneath_hooks(original)  # what this layer calls where it serves the call

    @functools.wraps(original)
    def prepare_inputs_for_generation(self, *args, **kwargs):
        # transformers' assisted loop asks its first forward (the prefill) for the whole prompt, also when the call
        # continues a filled cache: inside a Domino call, read only what the cache does not hold, as `_prefill` does.
        call = _CALL.get()
        if call is None:  # no call of this copy's drafters
            return original(self, *args, **kwargs)
        if call.rollback is not None:
            # Everything the cache does not hold for certain: after a rolled-back verification, its verified tokens too.
            input_ids = args[0] if args else kwargs["input_ids"]  # once per forward: no signature binding
            kwargs["next_sequence_length"] = call.rollback.feed(input_ids.shape[1])
        elif (
            call.prefill_length is not None
            and kwargs.get("is_first_iteration")
            and kwargs.get("next_sequence_length") is None
        ):
            kwargs["next_sequence_length"] = call.prefill_length
        return unwrapped(self, *args, **kwargs)

    return prepare_inputs_for_generation


def _wrap_generate_batch(original):
    @functools.wraps(original)
    def generate_batch(self, *args, **kwargs):
        # transformers' continuous batching drops an assistant model without a word; a Domino drafter's call is ours.
        drafter = _domino_assistant(self, kwargs, original)
        if drafter is None:
            return original(self, *args, **kwargs)
        arguments = _bound_arguments(original, self, args, kwargs)
        call_kwargs = dict(arguments.pop("kwargs", {}))
        for name in ("self", "persistent_manager", "warmup"):  # no manager to keep or warm up
            arguments.pop(name, None)
        if kwargs.get("cache_implementation") == "paged":
            # generate() hands a paged call over with its model inputs too, which transformers' own generate_batch
            # ignores (the prompts are `inputs`, padding included): so does a drafted one.
            for name in ("input_ids", "attention_mask"):
                call_kwargs.pop(name, None)
        return generate_requests(self, drafter, **arguments, **call_kwargs)

    return generate_batch


def _wrap_init_continuous_batching(original):
    @functools.wraps(original)
    def init_continuous_batching(self, *args, **kwargs):
        # transformers' manager takes no assistant; a Domino drafter's is a drafted batch that requests join.
        drafter = _domino_assistant(self, kwargs, original)
        if drafter is None:
            return original(self, *args, **kwargs)
        return _drafted_manager(original, self, drafter, args, kwargs)

    return init_continuous_batching


def _wrap_continuous_batching_context_manager(original):
    @functools.wraps(original)
    def continuous_batching_context_manager(self, *args, **kwargs):
        drafter = _domino_assistant(self, kwargs, original)
        if drafter is None:
            return original(self, *args, **kwargs)
        arguments = _bound_arguments(original, self, args, _own(original, kwargs))
        block, timeout = arguments.get("block", True), arguments.get("timeout")
        return _started(_drafted_manager(original, self, drafter, args, kwargs), block, timeout)

    return continuous_batching_context_manager


def _domino_assistant(target, kwargs: dict[str, Any], original) -> Any:
    """Takes a drafter this layer (the wrapper of `original`) serves, passed as `assistant_model`, out of `kwargs`,
    else the one attached to `target` (its options added where the call sets none); None for anything else
    (`assistant_model=None` dropped, another copy's drafter left for its layer, another assistant for transformers'
    own error, which names it)."""
    if kwargs.get("assistant_model") is None:
        kwargs.pop("assistant_model", None)
        attached = attachment(target)
        if attached is None or not _serves(attached.drafter, original):
            return None
        for name, value in attached.options.items():
            kwargs.setdefault(name, value)
        return attached.drafter
    return kwargs.pop("assistant_model") if _serves(kwargs["assistant_model"], original) else None


def _own(method, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `method` takes (the rest are the drafter's options)."""
    return {name: value for name, value in kwargs.items() if name in _signature(method).parameters}


def _drafted_manager(original, target, drafter, args, kwargs) -> DraftedBatchingManager:
    """A `DraftedBatchingManager` from a call of transformers' manager entry point `original` with an assistant:
    its generation and batching configs, the drafter's options among the other keyword arguments. A manager's
    persistence, warm-up and workload hints size and keep transformers' paged cache, which a drafted batch does not
    use."""
    arguments = _bound_arguments(original, target, args, _own(original, kwargs))
    options = {name: value for name, value in kwargs.items() if name not in arguments}
    return DraftedBatchingManager(
        target, drafter, arguments.get("generation_config"), arguments.get("continuous_batching_config"), **options
    )


@contextlib.contextmanager
def _started(manager: DraftedBatchingManager, block: bool, timeout: float | None):
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout)


def _wrap_generate(original):
    unwrapped = _beneath_hooks(original)  # what this layer calls where it serves the call

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        attached = attachment(self)
        if attached is None or not _serves(attached.drafter, original):
            return original(self, *args, **kwargs)
        bound = _signature(original).bind(self, *args, **kwargs)
        if not wants_the_attached_drafter(bound.arguments, self):
            return original(self, *args, **kwargs)
        bound.arguments["assistant_model"] = attached.drafter
        bound.arguments["kwargs"] = {**attached.options, **bound.arguments.get("kwargs", {})}
        if bound.arguments.get("streamer") is not None:
            bound.arguments["streamer"] = PlainLoopStreamer(bound.arguments["streamer"])
        token = ATTACHED_CALL.set(self)
        try:
            return unwrapped(*bound.args, **bound.kwargs)
        except DrafterDeclined as declined:
            logger.warning_once(
                f"The attached Domino drafter does not serve this call, the target alone does: {declined}"
            )
        finally:
            ATTACHED_CALL.reset(token)
        plain = {name: value for name, value in kwargs.items() if name not in DominoOptions.names()}
        return unwrapped(self, *args, **plain)

    return generate


_WRAPPERS = {
    "_extract_generation_mode_kwargs": _wrap_extract_generation_mode_kwargs,
    "_validate_generation_mode": _wrap_validate_generation_mode,
    "_assisted_decoding": _wrap_assisted_decoding,
    "_get_candidate_generator": _wrap_get_candidate_generator,
    "prepare_inputs_for_generation": _wrap_prepare_inputs_for_generation,
    "generate_batch": _wrap_generate_batch,
    "init_continuous_batching": _wrap_init_continuous_batching,
    "continuous_batching_context_manager": _wrap_continuous_batching_context_manager,
    "generate": _wrap_generate,
}


def install_assisted_generation_hook() -> None:
    """Lets `generate(assistant_model=<Domino drafter>)` use `DominoCandidateGenerator`; other calls are untouched."""
    for name, wrap in _WRAPPERS.items():
        current = getattr(GenerationMixin, name, None)
        if _layer_installed(current):
            continue
        parameters = inspect.signature(current).parameters if current is not None else {}
        missing = [p for p in _REQUIRED_PARAMETERS[name] if p not in parameters]
        if current is None or missing or not hasattr(CandidateGenerator, "requires_model_outputs"):
            raise ImportError(
                f"Domino's generate() integration relies on transformers' GenerationMixin.{name} "
                f"(parameters {list(_REQUIRED_PARAMETERS[name])}) and CandidateGenerator.requires_model_outputs, "
                f"which transformers {transformers.__version__} changed. Install transformers>=5.23,<6."
            )
        wrapper = wrap(current)
        wrapper.__domino_hook__ = True  # what copies before layers per copy look for: they then install nothing
        wrapper.__domino_code__ = _CODE
        setattr(GenerationMixin, name, wrapper)


def _layer_installed(method) -> bool:
    """Whether this copy's layer already wraps `method` (beneath other copies' layers, maybe)."""
    while _is_hook(method):
        if getattr(method, "__domino_code__", None) == _CODE:
            return True
        method = method.__wrapped__
    return False
