"""How a recurrent family's multi-token scan is recorded and replayed: the chunked Gated DeltaNet rule, Kimi Delta
Attention and the Mamba2 chunk scan (`ScanFamily`), wrapped once per process (`replayable_scan`) to keep the inputs a
verification's scan reads, from which `recurrent_cache_domino.RecurrentRollback` recomputes the state after the
verification's accepted tokens.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from collections.abc import Callable

import torch

# A family with recurrent layers runs a forward of several tokens through a scan, a function of its modeling module:
# the chunked Gated DeltaNet rule (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid), its Kimi Delta Attention variant
# (Kimi-Linear, BailingHybrid) or the Mamba2 chunk scan (Nemotron-H, Falcon-H1, Granite 4, Mamba2). With the scan's
# inputs kept, the state after any prefix of a verification is recomputed from them, from the state the forward
# started from: a rejected draft then costs no re-read.
# A forward over more tokens (a prompt) keeps no inputs: it is never rolled back in part.
RULE_INPUT_TOKENS = 64


class _ScanInputs(list):
    """The scan inputs a forward keeps, in layer order, for scans of at most `widest` tokens."""

    def __init__(self, widest: int = RULE_INPUT_TOKENS):
        super().__init__()
        self.widest = widest


# The scan's inputs of the current forward; None outside a verification.
_RULE_INPUTS: contextvars.ContextVar[_ScanInputs | None] = contextvars.ContextVar("domino_rule_inputs", default=None)


class ScanFamily:
    """How a family's multi-token scan is recorded (`chunked`, a function of its modeling module, whose `per_token`
    arguments are (batch, tokens, ...) tensors) and how the states after the first `kept` tokens of a recorded call
    are recomputed (`states_after`)."""

    chunked: str
    per_token: tuple[str, ...]

    def __init__(self, module):
        self.module = module

    @classmethod
    def found_in(cls, module) -> bool:
        return callable(getattr(module, cls.chunked, None))

    def states_after(self, inputs: list[dict], before: list[torch.Tensor]) -> list[torch.Tensor]:
        """The state after the tokens of each layer's `inputs` (already cut to the kept tokens), from `before`."""
        raise NotImplementedError


class GatedDeltaScan(ScanFamily):
    """Replayed by the family's recurrent rule (what the target alone's one-token steps run), all layers of one
    device, dtype and shape in one call: the rule has no per-layer parameters. On a CPU, more than one kept token goes
    through the chunked rule as one chunk instead: the recurrent rule reads and writes every state once per token,
    memory-bound there (208 ms for 16 tokens of a Qwen3.5-0.8B-shaped target's 18 layers, against 30 ms as one chunk:
    `examples/recurrent_targets.py`, docs/benchmarks.md)."""

    chunked, per_token = "torch_chunk_gated_delta_rule", ("query", "key", "value", "g", "beta")
    RECURRENT_RULE = "torch_recurrent_gated_delta_rule"

    @classmethod
    def found_in(cls, module) -> bool:
        return super().found_in(module) and hasattr(module, cls.RECURRENT_RULE)

    def states_after(self, inputs: list[dict], before: list[torch.Tensor]) -> list[torch.Tensor]:
        groups: dict[tuple, list[int]] = {}  # a target split over GPUs has several
        for index, (state, kept_inputs) in enumerate(zip(before, inputs)):
            key = (state.device, state.dtype, tuple(state.shape), tuple(kept_inputs["query"].shape))
            groups.setdefault(key, []).append(index)
        states: list[torch.Tensor] = [None] * len(before)
        for (device, _, _, shape), indices in groups.items():
            stacked = {name: torch.cat([inputs[i][name] for i in indices]) for name in self.per_token}
            kept = shape[1]
            rule, chunk = getattr(self.module, self.RECURRENT_RULE), {}
            if device.type == "cpu" and kept > 1:
                rule, chunk = getattr(self.module, self.chunked), {"chunk_size": kept}
            _, final = rule(
                stacked["query"],
                stacked["key"],
                stacked["value"],
                g=stacked["g"],
                beta=stacked["beta"],
                initial_state=torch.cat([before[i] for i in indices]),
                output_final_state=True,
                use_qk_l2norm_in_kernel=inputs[indices[0]].get("use_qk_l2norm_in_kernel", False),
                **chunk,
            )
            for index, state in zip(indices, final.chunk(len(indices))):
                states[index] = state
        return states


class KimiDeltaScan(GatedDeltaScan):
    """Kimi Delta Attention (Kimi-Linear, BailingHybrid): the Gated DeltaNet rule with a forget gate per key channel
    rather than per head, called with the same arguments, so it is replayed the same way."""

    chunked = "chunk_kimi_delta_attention"
    RECURRENT_RULE = "recurrent_kimi_delta_attention"


class Mamba2Scan(ScanFamily):
    """Replayed by the chunk scan itself over the kept tokens, one call per layer (A, D and dt_bias are the layer's)."""

    chunked, per_token = "mamba2_chunk_scan", ("hidden_states", "dt", "B", "C")
    POSITIONAL = ("hidden_states", "dt", "A", "B", "C")

    def states_after(self, inputs: list[dict], before: list[torch.Tensor]) -> list[torch.Tensor]:
        states = []
        for kept_inputs, state in zip(inputs, before):
            # As the mixers call it: the per-token tensors and A by position (the kernels that may replace the
            # reference name them otherwise), the rest by name.
            positional = [kept_inputs[name] for name in self.POSITIONAL]
            named = {name: value for name, value in kept_inputs.items() if name not in self.POSITIONAL}
            named.update(initial_states=state, return_final_states=True)
            if state.device.type == "cpu":
                named["chunk_size"] = positional[0].shape[1]
            states.append(getattr(self.module, self.chunked)(*positional, **named)[1])
        return states


SCAN_FAMILIES = (GatedDeltaScan, KimiDeltaScan, Mamba2Scan)


def _one_chunk_on_cpu(names: list[str], args: tuple, kwargs: dict, tokens: torch.Tensor) -> tuple[tuple, dict]:
    """A scan's arguments with `chunk_size` the length of `tokens` where they lie on a CPU. The PyTorch reference
    pads every call to a multiple of its chunk (64 tokens for the Gated DeltaNet rule, 128-256 for Mamba2's), so a
    17-token verification scans 64-256 positions: up to 100 ms per layer at Nemotron-H-8B's widths on a CPU, against
    1-4 ms as one chunk of 17. Chunks are a way of computing the same scan (the states agree to fp32 rounding). Only
    on a CPU, where the reference always runs: on a GPU the fused kernels that replace it choose their own chunks."""
    if tokens.device.type != "cpu" or "chunk_size" not in names:
        return args, kwargs
    position = names.index("chunk_size")  # the arguments from there on go by name
    kwargs = {**kwargs, **dict(zip(names[position:], args[position:]))}
    return args[:position], {**kwargs, "chunk_size": tokens.shape[1]}


def _parameter_names(scan: Callable) -> list[str]:
    """The names of `scan`'s parameters, in order. With the `kernels` package installed, transformers >= 5.25 makes
    each function a hub kernel may replace a module (kernels' `Func`) whose forward, taking `*args, **kwargs`, calls
    the function: the names are that function's, read from the forward's closure."""
    function = inspect.unwrap(scan)  # beneath other copies' recording wrappers
    if isinstance(function, torch.nn.Module):
        cells = getattr(type(function).forward, "__closure__", None) or ()
        function = next((cell.cell_contents for cell in cells if inspect.isfunction(cell.cell_contents)), function)
    return list(inspect.signature(function).parameters)


def _recording(scan: Callable, family: type[ScanFamily]) -> Callable:
    """`scan` (a family's multi-token scan), keeping its inputs where one of this copy's verifications asks for them."""
    names = _parameter_names(scan)  # its arguments by name, without binding at every layer

    @functools.wraps(scan, updated=())  # `updated=()`: a kernels `Func` module's attributes stay on the module
    def recording_scan(*args, **kwargs):
        # A compiled forward (the user's own) is traced through untouched, the context variable never read there.
        kept = None if torch.compiler.is_compiling() else _RULE_INPUTS.get()
        if kept is not None:
            tokens = {**dict(zip(names, args)), **kwargs}.get(family.per_token[0])
            if tokens is not None and tokens.shape[1] <= kept.widest:
                args, kwargs = _one_chunk_on_cpu(names, args, kwargs, tokens)
                kept.append({**dict(zip(names, args)), **kwargs})
            else:  # a prompt, or another signature than the one replayed: rolled back whole
                kept.append(None)
        return scan(*args, **kwargs)

    recording_scan.domino_records = _RULE_INPUTS  # whose verifications it records: this copy's
    return recording_scan


def _records_for_this_copy(scan: Callable) -> bool:
    """Whether this copy's recording wrapper is among those around `scan`. Each copy of this code in a process (the
    package, a drafter folder's remote code) keeps a verification's inputs in a context variable of its own, so each
    wraps the scan once; the wrappers of copies that are not verifying pass the call through."""
    while hasattr(scan, "domino_records"):
        if scan.domino_records is _RULE_INPUTS:
            return True
        scan = scan.__wrapped__
    return False


def _scan_family(target) -> ScanFamily | None:
    """The scan of `target`'s modeling module whose states can be kept for part of a verification, else None."""
    module = sys.modules.get(type(target).__module__)
    family = next((family for family in SCAN_FAMILIES if module is not None and family.found_in(module)), None)
    return None if family is None else family(module)


def has_replayable_scan(target) -> bool:
    """Whether `target`'s family runs a scan whose states can be kept for part of a verification (the Gated DeltaNet
    rule: Qwen3.5, Qwen3-Next, OLMo-Hybrid; Kimi Delta Attention: Kimi-Linear, BailingHybrid; the Mamba2 scan:
    Nemotron-H, Falcon-H1, Granite 4, Mamba2)."""
    return _scan_family(target) is not None


def replayable_scan(target) -> ScanFamily | None:
    """The scan family of `target`, its multi-token scan wrapped to keep a verification's inputs (once per process
    and copy of this code: the wrapper passes calls through unchanged outside a drafting call), or None for a family
    without one, whose rejected verifications are rolled back whole."""
    family = _scan_family(target)
    if family is not None and not _records_for_this_copy(getattr(family.module, family.chunked)):
        setattr(family.module, family.chunked, _recording(getattr(family.module, family.chunked), type(family)))
    return family


def expect_scan_inputs(widest: int | None) -> None:
    """The scans of the next forward keep their inputs where they read at most `widest` tokens (None: keep none)."""
    _RULE_INPUTS.set(None if widest is None else _ScanInputs(widest))


def take_scan_inputs() -> dict | None:
    """The inputs of the scan that ran last (a layer's, layers running one after another), or None where it kept
    none."""
    kept = _RULE_INPUTS.get()
    return kept.pop() if kept else None


__all__ = [
    "RULE_INPUT_TOKENS",
    "SCAN_FAMILIES",
    "GatedDeltaScan",
    "KimiDeltaScan",
    "Mamba2Scan",
    "ScanFamily",
    "expect_scan_inputs",
    "has_replayable_scan",
    "replayable_scan",
    "take_scan_inputs",
]
