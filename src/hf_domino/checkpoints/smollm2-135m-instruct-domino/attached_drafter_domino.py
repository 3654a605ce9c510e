"""A drafter attached to its target: the assistant of the target's calls that name none (`attach_drafter`).

Code that calls `generate()` without an assistant (`transformers serve`, evaluation harnesses) cannot pass one, and
inside `generate()` the decoding mode is chosen from its `assistant_model` argument before any other hook sees the
call, so the generate() hook (`generate_hook_domino`) wraps `generate` itself: for a target holding an attachment and
a call that `wants_the_attached_drafter`, it passes the drafter, and a refusal of the drafter before any work
(`DrafterDeclined`) hands the call back to the target alone. This module holds the attachment and those rules.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from transformers.generation.streamers import BaseStreamer

from .options_domino import DominoOptions, check_drafter_for_target

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .configuration_domino import DominoConfig
    from .modeling_domino import DominoForSpeculation


def is_domino_drafter(model: Any) -> bool:
    """Whether `model` is a Domino drafter of any copy of this code (the package's, or a checkpoint's remote code)."""
    return bool(getattr(model, "_is_domino_drafter", False))


def drafter_code(model: Any) -> str | None:
    """The package of the copy of this code that built `model` ("hf_domino", or a checkpoint's remote-code package
    such as "transformers_modules.my_drafter"), subclasses included; None for no Domino drafter."""
    for cls in type(model).__mro__:
        if "_is_domino_drafter" in vars(cls):
            return cls.__module__.rpartition(".")[0]
    return None


ATTACHED = "_domino_attached"  # the target's attribute, set past nn.Module's registries (not a submodule)
# Whether the running generate() call drafts because a drafter is attached (not asked for): a refusal of the drafter
# before any work then hands the call to the target alone (`DrafterDeclined`).
ATTACHED_CALL: contextvars.ContextVar[object | None] = contextvars.ContextVar("domino_attached_call", default=None)
# Settings under which generate() runs a decoding mode of its own or another assistant: no drafter is attached there.
OTHER_MODES = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "dola_layers", "constraints")


class Attachment(NamedTuple):
    drafter: Any
    options: dict[str, Any]


class DrafterDeclined(Exception):
    """A generate() call that did not ask for the attached drafter cannot be served by it (the reason)."""


def attach_drafter(target: PreTrainedModel, drafter: DominoForSpeculation, **options: Any) -> PreTrainedModel:
    """Makes `drafter` the assistant of `target`'s calls that name none: `generate()` (and so pipelines),
    `generate_batch()`, `init_continuous_batching()` and `continuous_batching_context_manager()`, with `options`
    (Domino options, e.g. `domino_lookup=False`) where a call sets none. For code that calls `generate()` without an
    assistant (`transformers serve`, evaluation harnesses): their outputs are the target alone's, as with
    `assistant_model=drafter`.

    A call that passes its own `assistant_model`, or asks for beam search, prompt lookup, DoLa or a `custom_generate`,
    runs as it would without the drafter; so does one the drafter refuses before any work (logged once per reason).
    Returns `target`; `detach_drafter` undoes it. The attachment is the target object's (a deep copy carries a copy).
    """
    if not is_domino_drafter(drafter):
        raise TypeError(
            f"attach_drafter takes a Domino drafter (DominoForSpeculation), got {type(drafter).__name__}: load one "
            "with AutoModel.from_pretrained(path, trust_remote_code=True)."
        )
    check_drafter_for_target(drafter, target)
    check_options(options, drafter.config, target.generation_config, drafter.device)
    object.__setattr__(target, ATTACHED, Attachment(drafter, dict(options)))
    return target


def check_options(
    options: dict[str, Any], drafter_config: DominoConfig, generation_config=None, device: Any = None
) -> None:
    """Raises, naming the fix, for `options` that `attach_drafter` refuses with a drafter of `drafter_config` (on
    `device`, where given): unknown names (`TypeError`), values out of range or a rollout the device cannot run
    (`ValueError`)."""
    unknown = sorted(set(options) - set(DominoOptions.names()))
    if unknown:
        raise TypeError(
            f"attach_drafter got unknown options {unknown}: Domino options are {list(DominoOptions.names())}."
        )
    resolved = DominoOptions.resolve(options, generation_config)
    resolved.validate_for(drafter_config)
    if device is not None:
        resolved.validate_device(device)


def attachment(target) -> Attachment | None:
    return vars(target).get(ATTACHED)


def detach_drafter(target: PreTrainedModel) -> DominoForSpeculation | None:
    """Undoes `attach_drafter`: `target`'s calls run without a drafter again. Returns the drafter (None if none)."""
    attached = target.__dict__.pop(ATTACHED, None)
    return None if attached is None else attached.drafter


def attached_drafter(target: PreTrainedModel) -> DominoForSpeculation | None:
    """The drafter `attach_drafter` gave `target`, or None."""
    attached = attachment(target)
    return None if attached is None else attached.drafter


def _setting(name: str, generation_config, kwargs: dict[str, Any], target) -> Any:
    """A generation setting as generate() will read it: the call's keyword, its config's, else the model's."""
    for source in (kwargs, vars(generation_config) if generation_config is not None else {}):
        if source.get(name) is not None:
            return source[name]
    return getattr(target.generation_config, name, None)


def wants_the_attached_drafter(arguments: dict[str, Any], target) -> bool:
    """Whether a generate() call may draft with the attached drafter: it names no assistant, decoding mode or
    `custom_generate` of its own, searches greedily or samples (num_beams 1), and is no continuous-batching call
    (whose `generate_batch` takes the attached drafter itself)."""
    if arguments.get("assistant_model") is not None or arguments.get("custom_generate") is not None:
        return False
    config, kwargs = arguments.get("generation_config"), arguments.get("kwargs", {})
    if kwargs.get("cache_implementation") == "paged":  # generate() hands the call to generate_batch, which takes it
        return False
    if any(_setting(name, config, kwargs, target) for name in OTHER_MODES):
        return False
    return (_setting("num_beams", config, kwargs, target) or 1) == 1


class PlainLoopStreamer(BaseStreamer):
    """A streamer fed as generate()'s plain loop feeds it: transformers' assisted loop puts each cycle's tokens as
    `[1, n]`, where the plain loop puts `[n]` after the prompt, which streamers written for it iterate
    (`transformers serve`'s reads `value.tolist()` as token ids)."""

    def __init__(self, streamer: BaseStreamer):
        self.streamer, self.prompt_put = streamer, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_put and value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        self.prompt_put = True
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


__all__ = [
    "ATTACHED_CALL",
    "DrafterDeclined",
    "PlainLoopStreamer",
    "attach_drafter",
    "attached_drafter",
    "attachment",
    "check_options",
    "detach_drafter",
    "drafter_code",
    "is_domino_drafter",
    "wants_the_attached_drafter",
]
