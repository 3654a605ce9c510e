"""The target's modules a Domino drafter borrows (its input embeddings and LM head), run where the target runs them.

A drafter owns neither embeddings nor an LM head. It embeds its block with the target's table and turns its output
into logits with the target's head, over the whole vocabulary or a draft vocabulary's rows (kept per weight:
`vocab_rows`). A target that accelerate dispatched with offloaded parts keeps those weights on the meta device between
forwards: they are read where accelerate keeps them (`offloaded_weights`) and run on the hook's device
(`execution_device`). Also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel


@dataclass(frozen=True)
class TargetModules:
    """The two target modules a drafter borrows: the input embedding table and the LM head."""

    embed_tokens: nn.Module
    lm_head: nn.Module

    @classmethod
    def from_target(cls, target: PreTrainedModel) -> TargetModules:
        embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed_tokens is None or lm_head is None:
            raise ValueError(
                f"{type(target).__name__} does not expose input and output embeddings "
                "(get_input_embeddings()/get_output_embeddings()); a Domino drafter needs both from its target."
            )
        return cls(embed_tokens=embed_tokens, lm_head=lm_head)

    def embed(self, input_ids: torch.LongTensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        embed_tokens = self.embed_tokens
        if (
            type(embed_tokens) is nn.Embedding
            and embed_tokens.weight.device.type == "meta"
            and not embed_tokens.max_norm
        ):
            # An offloaded table: its hook would bring all of it in for each call (one per draft of a block), where
            # a lookup needs a few rows. Read them where accelerate keeps the table.
            table = offloaded_weights(embed_tokens)["weight"]
            return table[input_ids.to(table.device)].to(device=device, dtype=dtype)
        return embed_tokens(input_ids.to(execution_device(embed_tokens))).to(device=device, dtype=dtype)

    def logits(self, hidden_states: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The target's LM head on `hidden_states`, over the whole vocabulary or only the token ids in `vocab`."""
        weight = self.lm_head.weight
        if not isinstance(weight, torch.Tensor):
            # A head quantized by torch.ao (`quantize_dynamic`) keeps its weight packed behind a method and takes
            # float input: run it whole and keep the vocabulary's columns, the logits a draft vocabulary would give.
            logits = self.lm_head(hidden_states.float())
            return logits if vocab is None else logits[..., vocab.to(logits.device)]
        hidden_states = hidden_states.to(device=execution_device(self.lm_head), dtype=weight.dtype)
        if vocab is None:
            return self.lm_head(hidden_states)
        if weight.device.type == "meta":
            # An offloaded head: its hook brings the weight in for each forward. Read the vocabulary's rows once.
            return nn.functional.linear(hidden_states, *offloaded_vocab_rows(self.lm_head, vocab, hidden_states))
        rows_linear = getattr(self.lm_head, "rows_linear", None)
        if rows_linear is not None:  # a head that keeps its own fast form of row subsets (hf_domino.cpu_fast_path)
            return rows_linear(hidden_states, vocab)
        bias = getattr(self.lm_head, "bias", None)
        return nn.functional.linear(
            hidden_states, vocab_rows(weight, vocab), None if bias is None else vocab_rows(bias, vocab)
        )


_VOCAB_ROWS: dict[tuple, tuple[torch.Tensor, weakref.ref, torch.Tensor]] = {}


def vocab_rows(weight: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """`weight[vocab]`, cached: the rows of an output projection for a draft vocabulary (FR-Spec).

    Gathering them costs as much as a few draft blocks, so they are kept per (weight, its in-place version and its
    `.data` handed out where the CPU fast path watches it, vocab) for the process; a handful of entries covers every drafter/target pair in use. A weight being trained gets a
    differentiable gather instead: it changes every step, and its gradient must reach the rows.
    """
    if weight.requires_grad and torch.is_grad_enabled():
        return weight[vocab.to(weight.device)]
    key = (
        weight.data_ptr(),
        _version(weight),
        getattr(weight, "data_handed_out", 0),
        tuple(weight.shape),
        weight.device,
    )
    key += (vocab.data_ptr(), _version(vocab), vocab.numel())
    entry = _VOCAB_ROWS.get(key)
    # The entry holds `vocab`, so no other tensor can take its address while the entry exists, and a weak reference
    # to `weight`, so a new model's weight at a freed one's address is not taken for it.
    if entry is None or entry[1]() is not weight:
        if len(_VOCAB_ROWS) >= 8:
            _VOCAB_ROWS.clear()
        reference = weakref.ref(weight, functools.partial(_forget_vocab_rows, key))  # rows freed with their model
        entry = _VOCAB_ROWS[key] = (vocab, reference, weight.detach()[vocab.to(weight.device)].contiguous())
    return entry[2]


def _forget_vocab_rows(key: tuple, reference: weakref.ref) -> None:
    entry = _VOCAB_ROWS.get(key)
    if entry is not None and entry[1] is reference:  # not a later entry at the freed weight's address
        del _VOCAB_ROWS[key]


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; -1 for inference tensors (models loaded under `torch.inference_mode()`),
    which have none."""
    return -1 if tensor.is_inference() else tensor._version


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its parameters' device, or, for a module accelerate dispatched with offloading
    (`from_pretrained(..., device_map=...)` with "cpu" or "disk" parts), the device its hook brings the weights to for
    each forward, while they wait on the meta device."""
    for hook in _accelerate_hooks(module):
        if getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
    # The embedding and the head are asked once per draft of a block: their weight, without a walk of parameters().
    weight = getattr(module, "weight", None)
    return weight.device if isinstance(weight, torch.Tensor) else next(module.parameters()).device


def _accelerate_hooks(module: nn.Module) -> tuple:
    hook = getattr(module, "_hf_hook", None)
    return () if hook is None else getattr(hook, "hooks", (hook,))  # a SequentialHook chains several


def offload_hooked(module: nn.Module) -> bool:
    """Whether accelerate dispatched `module` with offloading: its hook calls the forward the module had when it was
    dispatched (a class swapped in since would never run) and may put other weights in place for each forward."""
    return hasattr(module, "_hf_hook") or module.weight.device.type == "meta"


def dense_weight(weight: torch.Tensor) -> bool:
    """Whether `weight` is a plain tensor: a quantized one (torchao's tensor subclasses) reports the float dtype it
    computes in, but only its own kernels read it."""
    return type(weight) in (torch.Tensor, nn.Parameter)


def offloaded_weights(module: nn.Module) -> Mapping[str, torch.Tensor]:
    """The weights accelerate keeps for an offloaded `module` (in CPU memory, or read from disk), by parameter name."""
    return next(
        hook.weights_map for hook in _accelerate_hooks(module) if getattr(hook, "weights_map", None) is not None
    )


def target_execution_device(target: PreTrainedModel) -> torch.device:
    """Where a target reads its input: `target.device`, except for a target whose input embeddings accelerate
    offloaded (`target.device` is then the meta device)."""
    embeddings = target.get_input_embeddings()
    return target.device if embeddings is None else execution_device(embeddings)


_OFFLOADED_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def offloaded_vocab_rows(
    head: nn.Module, vocab: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`vocab_rows` of an output projection accelerate offloaded (weight and bias, on `like`'s device and dtype), read
    once from the offloaded weights its hook keeps: the hook would bring in the whole vocabulary for every draft block."""
    rows = _OFFLOADED_ROWS.get(head)
    if rows is None or not (rows[0] is vocab or torch.equal(rows[0], vocab.to(rows[0].device))):
        weights = offloaded_weights(head)
        index = vocab.to(weights["weight"].device)
        parts = [
            weights[name][index].to(device=like.device, dtype=like.dtype) if name in weights else None
            for name in ("weight", "bias")
        ]
        rows = _OFFLOADED_ROWS[head] = (vocab, *parts)
    return rows[1], rows[2]


__all__ = [
    "TargetModules",
    "dense_weight",
    "execution_device",
    "offload_hooked",
    "offloaded_vocab_rows",
    "offloaded_weights",
    "target_execution_device",
    "vocab_rows",
]
