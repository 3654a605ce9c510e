"""Domino drafting inside transformers' own assisted-decoding loop.

`target.generate(..., assistant_model=drafter)` with a `DominoForSpeculation` drafter must pick our candidate
generator, but transformers 5.x has no public way to plug one in. `install_assisted_generation_hook()` wraps three
`GenerationMixin` methods; each wrapper hands over to the original unchanged unless the assistant is a Domino drafter:

- `_validate_generation_mode`: checks drafter/target compatibility before any generation work;
- `_assisted_decoding`: remembers the call's stopping criteria (the generator needs them, see `_truncate_at_stop`);
- `_get_candidate_generator`: returns `drafter.build_candidate_generator(...)`.

The hook is installed when the drafter's module is imported (from `hf_domino` or as remote code), is idempotent, and
refuses to install on a transformers whose methods no longer have the parameters it relies on.

This file is also written next to exported checkpoints as remote code, so it imports only transformers and torch.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

if TYPE_CHECKING:
    from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

    from .modeling_domino import DominoForSpeculation, TargetModules


@dataclass
class DominoGenerationStats:
    """What one `generate()` call did with a drafter; read it from `drafter.last_generation_stats` afterwards.

    `acceptance_lengths[i]` is the number of tokens the i-th target forward after the prefill added (accepted drafts
    plus the target's own token); `drafted[i]` how many drafts it verified. `timings` (seconds per iteration, only when
    `drafter.record_timings` is set) splits each cycle into `backbone`, `lm_head` (base logits of the draft block),
    `head` (the sequential rollout: Domino head and token picking) and `verify` (target forward and acceptance, timed
    from the end of drafting to the loop's next call).
    """

    acceptance_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    timings: dict[str, list[float]] | None = None

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


# ------------------------------------------------------------------------------------------------ compatibility checks
STATIC_CACHES = ("static", "hybrid", "sliding_window", "offloaded_static", "offloaded_hybrid")


def check_drafter_for_target(drafter: DominoForSpeculation, target: PreTrainedModel, generation_config=None) -> None:
    """Raises a `ValueError` that names the problem and the fix when `drafter` cannot draft for `target`."""
    config, target_config = drafter.config, target.config.get_text_config()
    if getattr(target.config, "is_encoder_decoder", False):
        raise ValueError("Domino drafters work with decoder-only targets; this target is an encoder-decoder model.")
    num_layers = getattr(target_config, "num_hidden_layers", None)
    if num_layers is None:
        raise ValueError(
            f"{type(target).__name__} does not report num_hidden_layers, so it cannot provide the per-layer hidden "
            "states (output_hidden_states) a Domino drafter reads."
        )
    if target_config.vocab_size != config.vocab_size:
        raise ValueError(
            f"The drafter's vocab_size ({config.vocab_size}) differs from the target's ({target_config.vocab_size}): "
            "a drafter uses its target's tokenizer, embeddings and LM head. Use a drafter trained for this target."
        )
    if target_config.hidden_size != config.hidden_size:
        raise ValueError(
            f"The drafter's hidden_size ({config.hidden_size}) differs from the target's ({target_config.hidden_size})"
            ": the drafter reads the target's hidden states. Use a drafter trained for this target."
        )
    bad_layers = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad_layers:
        raise ValueError(
            f"target_layer_ids {bad_layers} are outside the target's {num_layers} layers: this drafter was built for "
            f"a deeper target (num_target_layers={config.num_target_layers})."
        )
    if generation_config is None:
        return
    if generation_config.num_return_sequences and generation_config.num_return_sequences > 1:
        raise ValueError(
            "Domino drafting verifies one sequence at a time: num_return_sequences must be 1. Call generate() "
            "several times (with do_sample=True) for several samples."
        )
    if generation_config.cache_implementation in STATIC_CACHES:
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} cannot be rolled back after a "
            "rejected draft; Domino drafting needs the default dynamic cache. Drop cache_implementation."
        )
    if getattr(generation_config, "speculation_type", None) is not None:
        raise ValueError(
            f"speculation_type={generation_config.speculation_type!r} selects another transformers drafting path; "
            "a Domino drafter drafts by itself. Remove it (for DFlash-style drafting use drafter.domino_head(False))."
        )


# ------------------------------------------------------------------------------------------------ candidate generator
class DominoCandidateGenerator(CandidateGenerator):
    """Drafts one block per iteration of transformers' assisted-decoding loop.

    The loop hands us the target's outputs of the previous verification (`requires_model_outputs`): their hidden
    states at `target_layer_ids` for the tokens that were accepted become new drafter context. The drafter's cache
    only ever holds verified context, so a rejection needs no rollback on our side.
    """

    requires_model_outputs = True

    def __init__(
        self,
        drafter: DominoForSpeculation,
        target: PreTrainedModel,
        target_modules: TargetModules,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        input_ids: torch.LongTensor | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        **kwargs: Any,
    ):
        check_drafter_for_target(drafter, target, generation_config)
        if input_ids is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"Domino drafting supports batch size 1 (got {input_ids.shape[0]} sequences): transformers' "
                "assisted decoding verifies one sequence per target forward. Call generate() once per prompt."
            )
        self.drafter = drafter
        self.target = target_modules
        self.config = drafter.config
        self.max_length = generation_config.max_length
        self.max_drafts = drafter.drafts_per_block
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        # EOS and max length are already cut inside a block by the loop; other criteria (stop strings, ...) are not.
        self.block_stopping_criteria = [
            criterion
            for criterion in (stopping_criteria or [])
            if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria))
        ]
        layers = [i + 1 for i in self.config.target_layer_ids]  # hidden_states[0] is the embedding output
        # A user asking for all hidden states in the output needs them all from every forward.
        self.model_kwargs_overrides = {
            "output_hidden_states": True if generation_config.output_hidden_states else layers
        }
        self.fast_rollout = _select_fast_rollout(drafter, self.do_sample, logits_processor, target_modules)
        self.cache = DynamicCache()
        self.context_length = 0  # verified tokens whose features are in `self.cache`
        self.drafted_last = 0
        self.prefill_done = False
        self.stats = DominoGenerationStats(timings={} if drafter.record_timings else None)
        drafter.last_generation_stats = self.stats
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
            self.drafted_last = 0
            return input_ids, None
        self._tick("verify", self.drafted_last > 0)
        num_drafts = min(self.max_drafts, self.max_length - input_ids.shape[1] - 1)
        if num_drafts <= 0:  # the next target token is the last one anyway
            self.drafted_last = 0
            return input_ids, None
        context = self._new_context_features(input_ids, model_kwargs or {}, model_outputs, int(n_last_matches))
        with torch.no_grad():
            draft_ids, draft_logits = self._draft(input_ids, context, num_drafts)
        draft_ids, draft_logits = self._truncate_at_stop(input_ids, draft_ids, draft_logits)
        self.drafted_last = draft_ids.shape[1]
        self._tick("head", True)
        if self.drafted_last == 0:
            return input_ids, None
        return torch.cat([input_ids, draft_ids.to(input_ids.device)], dim=-1), draft_logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        # Every target forward after the prefill counts, including the few with no drafts (next to max_length or a
        # stop): the mean is then exactly generated tokens per decoding forward.
        if self.prefill_done:
            self.stats.acceptance_lengths.append(int(num_matches) + 1)
            self.stats.drafted.append(self.drafted_last)
        self.prefill_done = True

    # ------------------------------------------------------------------------------------------------------ steps
    def _new_context_features(
        self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any], model_outputs: Any, n_last_matches: int
    ) -> torch.Tensor:
        """Target features of the tokens verified since the last block, padding dropped, on the drafter's device."""
        hidden_states = getattr(model_outputs, "hidden_states", None)
        if hidden_states is None:
            raise ValueError(
                "The target returned no hidden_states although output_hidden_states was requested; a Domino drafter "
                "needs a target whose forward supports output_hidden_states."
            )
        # After the prefill every prompt token is new context; later, the accepted drafts plus the previous anchor.
        num_new = input_ids.shape[1] - 1 if self.context_length == 0 else n_last_matches + 1
        features = torch.cat([hidden_states[i + 1][:, :num_new] for i in self.config.target_layer_ids], dim=-1)
        attention_mask = model_kwargs.get("attention_mask")
        if self.context_length == 0 and attention_mask is not None and not bool(attention_mask[0, :num_new].all()):
            features = features[:, attention_mask[0, :num_new].bool().to(features.device)]
        return features.to(self.drafter.device)

    def _draft(
        self, input_ids: torch.LongTensor, context: torch.Tensor, num_drafts: int
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        drafter, config = self.drafter, self.config
        device = drafter.device
        start = self.context_length + context.shape[1]  # the anchor's position
        position_ids = torch.arange(self.context_length, start + config.block_size, device=device)[None]
        block_embeds = drafter.embed_block(self.target, input_ids)
        block_hidden = drafter(block_embeds, context, position_ids, past_key_values=self.cache)
        self.context_length = start
        self._tick("backbone", True)
        draft_hidden = drafter.draft_hidden_states(block_hidden)[:, :num_drafts]
        base_logits = self.target.logits(draft_hidden).float()
        self._tick("lm_head", True)
        if not drafter.head_active and self.logits_processor is None and not self.do_sample:
            return base_logits.argmax(dim=-1), base_logits  # nothing sequential left: vectorize
        if self.fast_rollout is not None:
            return self.fast_rollout(draft_hidden, base_logits, input_ids, self.target.embed_tokens.weight)
        return drafter.rollout(draft_hidden, base_logits, input_ids, self.target, self._pick)

    def _pick(self, logits: torch.Tensor, realised_ids: torch.LongTensor) -> tuple[torch.LongTensor, torch.Tensor]:
        """Chooses one draft from the same processed distribution the loop will use for the target."""
        logits = logits.float()
        if self.logits_processor is not None:
            logits = self.logits_processor(realised_ids.to(logits.device), logits)
        if self.do_sample:
            token = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
        else:
            token = logits.argmax(dim=-1, keepdim=True)
        return token.to(realised_ids.device), logits

    def _truncate_at_stop(
        self, input_ids: torch.LongTensor, draft_ids: torch.LongTensor, draft_logits: torch.Tensor | None
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Keeps drafts only up to the one before a stopping criterion would fire.

        The loop checks stopping criteria once per iteration, after the whole accepted block. If prefix + drafts[:j]
        completes a stop string, we offer only drafts[:j - 1]: the target's own next token then decides whether the
        stop happens, exactly as without a drafter, and nothing is generated past it.
        """
        if not self.block_stopping_criteria or draft_ids.shape[1] == 0:
            return draft_ids, draft_logits
        sequence = torch.cat([input_ids, draft_ids.to(input_ids.device)], dim=-1)
        for j in range(1, draft_ids.shape[1] + 1):
            prefix = sequence[:, : input_ids.shape[1] + j]
            if any(bool(criterion(prefix, None).any()) for criterion in self.block_stopping_criteria):
                return draft_ids[:, : j - 1], draft_logits[:, : j - 1]
        return draft_ids, draft_logits

    def _tick(self, name: str, record: bool) -> None:
        """Adds the time since the previous tick to `timings[name]` (only when timings were asked for)."""
        if self.stats.timings is None:
            return
        if self.drafter.device.type == "cuda":
            torch.cuda.synchronize(self.drafter.device)
        now = time.perf_counter()
        if record:
            self.stats.timings.setdefault(name, []).append(now - self._clock)
        self._clock = now


def _select_fast_rollout(drafter, do_sample: bool, logits_processor, target_modules):
    """The fused Triton/CUDA-graph head rollout of `hf_domino.triton_head` when it applies, else `None` (eager).

    Imported by name rather than relatively: remote-code copies of this file must not depend on it, and without
    `hf_domino` installed they simply use the eager rollout.
    """
    if drafter.rollout_mode == "eager" or not drafter.head_active:
        return None
    try:
        triton_head = importlib.import_module("hf_domino.triton_head")
    except ImportError:
        return None
    temperature, has_other_processors = triton_head.split_temperature(logits_processor)
    return triton_head.select_rollout(
        drafter,
        do_sample=do_sample,
        temperature=temperature,
        has_other_processors=has_other_processors,
        mode=drafter.rollout_mode,
        target_embed_weight=target_modules.embed_tokens.weight,
    )


# -------------------------------------------------------------------------------------------------- generate() hook
_STOPPING_CRITERIA: contextvars.ContextVar[StoppingCriteriaList | None] = contextvars.ContextVar(
    "domino_stopping_criteria", default=None
)
# The parameters each wrapped method must still have for the hook to be correct.
_REQUIRED_PARAMETERS = {
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
}


def is_domino_drafter(model: Any) -> bool:
    return bool(getattr(model, "_is_domino_drafter", False))


def _bound_arguments(method, self, args, kwargs) -> dict[str, Any]:
    return inspect.signature(method).bind(self, *args, **kwargs).arguments


def _wrap_validate_generation_mode(original):
    @functools.wraps(original)
    def _validate_generation_mode(self, *args, **kwargs):
        arguments = _bound_arguments(original, self, args, kwargs)
        assistant = (arguments.get("generation_mode_kwargs") or {}).get("assistant_model")
        if is_domino_drafter(assistant):
            check_drafter_for_target(assistant, self, arguments["generation_config"])
        return original(self, *args, **kwargs)

    return _validate_generation_mode


def _wrap_assisted_decoding(original):
    @functools.wraps(original)
    def _assisted_decoding(self, *args, **kwargs):
        arguments = _bound_arguments(original, self, args, kwargs)
        if not is_domino_drafter(arguments.get("assistant_model")):
            return original(self, *args, **kwargs)
        token = _STOPPING_CRITERIA.set(arguments.get("stopping_criteria"))
        try:
            return original(self, *args, **kwargs)
        finally:
            _STOPPING_CRITERIA.reset(token)

    return _assisted_decoding


def _wrap_get_candidate_generator(original):
    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        arguments = _bound_arguments(original, self, args, kwargs)
        assistant = arguments.get("assistant_model")
        if not is_domino_drafter(assistant):
            return original(self, *args, **kwargs)
        return assistant.build_candidate_generator(
            target=self,
            generation_config=arguments["generation_config"],
            logits_processor=arguments["logits_processor"],
            input_ids=arguments["input_ids"],
            stopping_criteria=_STOPPING_CRITERIA.get(),
        )

    return _get_candidate_generator


_WRAPPERS = {
    "_validate_generation_mode": _wrap_validate_generation_mode,
    "_assisted_decoding": _wrap_assisted_decoding,
    "_get_candidate_generator": _wrap_get_candidate_generator,
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
