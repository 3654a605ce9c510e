"""How a cache with recurrent layers (linear attention, state-space models) gives back a verification's rejected
drafts: `RecurrentRollback` keeps the states each forward started from and, where the family's scan allows, the inputs
it read, so that a state holds exactly the tokens kept; which targets keep such states (`keeps_recurrent_states`) and
which of them can verify drafts at all (`check_recurrent_target`), and which calls on them a drafter serves
(`check_recurrent_call`).

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs

from .cache_domino import cached_tokens

# transformers >= 5.25 rolls recurrent states back in its own assisted loop (per-token states kept by each forward),
# and no longer marks the models that keep them `_is_stateful`, which earlier releases refuse an assistant for.
TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES = (
    "recurrent_states_to_keep" in inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
)


# A family with recurrent layers runs a forward of several tokens through a scan, a function of its modeling module:
# the chunked Gated DeltaNet rule (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid), its Kimi Delta Attention variant
# (Kimi-Linear, BailingHybrid) or the Mamba2 chunk scan (Nemotron-H, Falcon-H1, Granite 4, Mamba2). With the scan's
# inputs kept, the state after any prefix of a verification is recomputed from them, from the state the forward
# started from: a rejected draft then costs no re-read.
# The scan's inputs of the current forward, in layer order; None outside a verification.
_RULE_INPUTS: contextvars.ContextVar[list | None] = contextvars.ContextVar("domino_rule_inputs", default=None)
# A forward over more tokens (a prompt) keeps no inputs: it is never rolled back in part.
RULE_INPUT_TOKENS = 64


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
            if tokens is not None and tokens.shape[1] <= RULE_INPUT_TOKENS:
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


def _keep_state_before(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
    """`update_recurrent_state` of a snapshot layer: the new state is kept by reference rather than copied into the
    old one's storage, so the state the forward started from survives as it was, with no copy per forward. The
    inputs the scan just read (this layer's: layers run one after another) go with it."""
    kept = _RULE_INPUTS.get()
    self.inputs_before[state_idx] = kept.pop() if kept else None  # None: no scan recorded for this layer
    if not self.is_recurrent_states_initialized[state_idx]:
        return super(type(self), self).update_recurrent_state(recurrent_states, state_idx, **kwargs)
    self.states_before[state_idx] = self.recurrent_states[state_idx]
    self.recurrent_states[state_idx] = recurrent_states.to(self.recurrent_states[state_idx].dtype)
    return self.recurrent_states[state_idx]


# transformers >= 5.25 can keep a recurrent layer's state after each of a forward's last tokens, to crop it later:
# it then runs those tokens one by one through the recurrent rule. `RecurrentRollback` keeps the state a forward
# started from and its scan's inputs instead, so it asks for none.
_KEEP_NO_STATES = {"recurrent_states_to_keep": 0} if TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES else {}


def record_past(cache: Cache) -> None:
    """`cache.activate_past_recording()` keeping no per-token recurrent states (any transformers version)."""
    cache.activate_past_recording(**_KEEP_NO_STATES)


def _record_no_states(self, **kwargs) -> None:
    """`activate_past_recording` of a snapshot layer: whatever transformers' loop asks to keep, no per-token states."""
    super(type(self), self).activate_past_recording(**_KEEP_NO_STATES)


def _crop_to_chosen_states(self, tokens_to_remove: int) -> None:
    """`crop` of a snapshot layer, whose recurrent states `RecurrentRollback` has already set. transformers >= 5.25
    sets each from the per-token history it keeps (`recurrent_states_history`), which these layers do not keep: the
    history it reads holds the state already chosen."""
    if TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES:  # also where no loop asked to record (a batch, a measurement)
        steps = abs(tokens_to_remove)
        self.recurrent_states_history = {index: [state] * steps for index, state in self.recurrent_states.items()}
    super(type(self), self).crop(tokens_to_remove)


def _restore_state_before(self) -> None:
    """Puts back the recurrent states the last forward started from."""
    for index, initialized in self.is_recurrent_states_initialized.items():
        if not initialized:
            continue
        if index not in self.states_before:
            raise RuntimeError(
                f"A recurrent state of {type(self).__name__} was not updated through the cache in the last forward, so "
                "it cannot be rolled back: this target cannot verify drafts. Generate without the drafter."
            )
        self.recurrent_states[index] = self.states_before[index]
    self.states_before = {}


@functools.cache
def _snapshot_class(layer_class: type) -> type:
    """`layer_class` (a linear-attention cache layer) keeping the recurrent states each forward started from, so that
    the forward can be rolled back whole (`restore`). A direct subclass: an instance's class can be swapped to it."""
    return type(
        f"Snapshot{layer_class.__name__}",
        (layer_class,),
        {
            "update_recurrent_state": _keep_state_before,
            "restore": _restore_state_before,
            "activate_past_recording": _record_no_states,
            "crop": _crop_to_chosen_states,
            "is_croppable": property(lambda self: True),  # whole forwards, through `RecurrentRollback`
        },
    )


class RecurrentRollback:
    """Rolls a cache with recurrent layers back where a verification rejects drafts, for transformers' assisted loop.

    A recurrent state (linear attention, a state-space layer) folds every token it reads into one tensor, so it
    cannot drop a verification's rejected drafts the way key/value columns are cropped; transformers < 5.25 refuses
    assisted generation for such targets, and 5.25 runs the last tokens of every forward one by one to keep a state
    per token (which this asks it not to: `record_past`). A forward whose drafts were all accepted is kept. One with rejected drafts keeps its
    verified tokens where the family's scan kept its inputs (`replayable_scan`: the Gated DeltaNet and Mamba2
    families): each state becomes the scan over the inputs it read for them, from the state the forward started
    from, and the other layers (attention, convolution history) are cropped by the rejected drafts. Where no inputs
    were kept (a compiled forward, a kernel that replaces the whole layer, a family without such a scan) it is rolled
    back whole: each recurrent state to what the forward started from, every other layer by the forward's tokens.
    The tokens it verified (the anchor and the accepted drafts) stay in the sequence, and the next forward reads them
    again with the new token (`feed`), verifying no drafts (the candidate generator's re-read, `lagging`), so that it
    is always kept: one more forward, about a plain step, which yields a token as a plain step does. Either way the
    states hold exactly the tokens of the sequence.

    Installed by the generate() hook for one call (`install`, `remove`); `committed` counts the tokens the cache
    holds for certain.
    """

    def __init__(self, cache: Cache, committed: int, scan: ScanFamily | None = None):
        """Makes the cache's linear-attention layers snapshot layers until `remove`."""
        self.cache, self.committed, self.fed = cache, committed, 0
        self.scan = scan
        self.layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.classes = [type(layer) for layer in self.layers]
        for layer in self.layers:
            layer.__class__ = _snapshot_class(type(layer))
            layer.states_before, layer.inputs_before = {}, {}

    @classmethod
    def install(cls, cache: Cache, committed: int, target=None) -> RecurrentRollback:
        rollback = cls(cache, committed, replayable_scan(target) if target is not None else None)
        cache.crop = rollback.crop  # transformers' loop crops after every verification
        return rollback

    @classmethod
    def install_for_rows(cls, cache: Cache, target) -> RecurrentRollback:
        """For a batch (`ragged_cache_domino.RaggedCache`, which crops its attention layers itself): each row keeps
        what it accepted (`keep_rows`). Families with a replayable scan only, whose states can be kept in part."""
        return cls(cache, 0, replayable_scan(target))

    def remove(self) -> None:
        """The cache as it was built, holding what the call left in it."""
        _RULE_INPUTS.set(None)
        for layer, layer_class in zip(self.layers, self.classes):
            layer.__class__ = layer_class
            layer.record_past = True  # as transformers' assisted loop left it
            del layer.states_before, layer.inputs_before
        self.cache.__dict__.pop("crop", None)

    def lagging(self, sequence_length: int) -> bool:
        """Whether the last verification was rolled back: the cache misses verified tokens of the sequence (all but
        its last token, which the next forward reads anyway)."""
        return self.committed < sequence_length - 1

    def feed(self, sequence_length: int) -> int:
        """How many of the sequence's last tokens the next forward reads: every one after the committed ones."""
        # A one-token forward is never rolled back: it runs the models' in-place step, as the target alone's does,
        # rather than the convolution over a recorded history that transformers' assisted loop asks for.
        fed = sequence_length - self.committed
        self._expect_forward(fed, verifying=fed > 1)
        return fed

    def _expect_forward(self, width: int, verifying: bool) -> None:
        """Before a forward of `width` tokens (per row): one that may be kept in part records its scan's inputs and
        its convolution history; any other runs as the target alone's would."""
        self.fed = width
        _RULE_INPUTS.set([] if verifying and self.scan is not None else None)
        for layer in self.layers:
            layer.states_before, layer.inputs_before = {}, {}
            layer.record_past = verifying

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop after a verification: nothing rejected keeps the forward; with rejected drafts, the
        states after the verified tokens where the scan's inputs were kept, else the whole forward rolled back (the
        tokens it verified are read again by the next one)."""
        _RULE_INPUTS.set(None)
        kept = self.fed - abs(tokens_to_remove)
        if tokens_to_remove == 0:
            if self.fed > 1:
                type(self.cache).crop(self.cache, 0)  # shrinks the recorded convolution history
        elif self._replay(kept):
            type(self.cache).crop(self.cache, tokens_to_remove)
        else:
            for layer in self.layers:
                layer.restore()
            type(self.cache).crop(self.cache, -self.fed)
            return
        self.committed += kept

    def before_rows_forward(self, width: int, first: bool) -> None:
        """A batch's forward of `width` columns per row: kept in part later (its scan inputs recorded, its convolution
        history kept) unless it is one column (the in-place step) or the call's first forward (never rolled back)."""
        self._expect_forward(width, verifying=width > 1 and not first)

    def keep_rows(self, kept: torch.LongTensor) -> None:
        """After a batch's verification, row b keeps the first `kept[b]` of the columns the forward read: its
        recurrent states become the scan over those (rows grouped by count; a row that kept every column keeps the
        forward's), its convolution window ends after them. Holes of shorter rows come after their tokens,
        so they are never among the kept. Layers of convolutions only (LFM2's) have no states to recompute."""
        _RULE_INPUTS.set(None)
        if self.fed <= 1 or not self.layers or not self.layers[0].record_past:
            return
        if any(any(layer.is_recurrent_states_initialized.values()) for layer in self.layers):
            self._keep_rows_states(kept.tolist())
        windows: dict[tuple, torch.Tensor] = {}  # the gather index, once per device and shape
        for layer in self.layers:
            conv, size = layer.conv_states[0], layer.conv_kernel_size[0]
            key = (conv.device, size, conv.shape[1])
            if key not in windows:
                start = kept.to(conv.device)[:, None, None] + torch.arange(size, device=conv.device)[None, None]
                windows[key] = start.expand(-1, conv.shape[1], -1)
            layer.conv_states[0] = torch.gather(conv, 2, windows[key])
            layer.record_past = False

    def _keep_rows_states(self, counts: list[int]) -> None:
        inputs = self._kept_inputs()
        if inputs is None:
            raise RuntimeError(
                "A batch's verification kept no scan inputs to keep its rows' states from: this target's layers do "
                "not run transformers' Gated DeltaNet rule or Mamba2 scan. Generate one sequence at a time."
            )
        for count in sorted(set(counts) - {self.fed}):
            rows = torch.tensor([row for row, n in enumerate(counts) if n == count])
            for layer, (state, rows_there) in zip(self.layers, self._states_after(inputs, count, rows)):
                layer.recurrent_states[0][rows_there] = state.to(layer.recurrent_states[0].dtype)

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keeps only these rows' states (finished rows leave a batch)."""
        for layer in self.layers:
            for index in range(layer.number_of_states):
                for states in (layer.conv_states, layer.recurrent_states):
                    if states[index] is not None:
                        states[index] = states[index][rows.to(states[index].device)]

    def _replay(self, kept: int) -> bool:
        """Sets each recurrent state to the one after the forward's first `kept` tokens, recomputed from the scan's
        kept inputs. False where some layer kept none (a prompt, a compiled forward): roll back whole."""
        inputs = self._kept_inputs()
        if inputs is None:
            return False
        for layer, (state, _) in zip(self.layers, self._states_after(inputs, kept)):
            layer.recurrent_states[0] = state.to(layer.states_before[0].dtype)
        return True

    def _kept_inputs(self) -> list[dict] | None:
        """Each layer's scan inputs of the last forward, or None where some layer kept none or had no state before
        it (so that no state can be recomputed)."""
        inputs = [layer.inputs_before.get(0) for layer in self.layers]
        if not inputs or any(i is None for i in inputs):
            return None
        if any(len(layer.inputs_before) != 1 or 0 not in layer.states_before for layer in self.layers):
            return None
        return inputs

    def _states_after(
        self, inputs: list[dict], kept: int, rows: torch.LongTensor | None = None
    ) -> list[tuple[torch.Tensor, torch.LongTensor | None]]:
        """Per layer: its state after the forward's first `kept` tokens (of `rows` only, where given), and `rows` on
        the state's device (a target split over GPUs keeps states on several)."""
        on_device: dict[torch.device, torch.LongTensor | None] = {}
        cut, before = [], []
        for layer, layer_inputs in zip(self.layers, inputs):
            state = layer.states_before[0]
            if state.device not in on_device:
                on_device[state.device] = None if rows is None else rows.to(state.device)
            rows_there = on_device[state.device]
            cut.append({
                name: (value if rows_there is None else value[rows_there])[:, :kept] if name in self.scan.per_token
                else value
                for name, value in layer_inputs.items()
            })  # fmt: skip
            before.append(state if rows_there is None else state[rows_there])
        states = self.scan.states_after(cut, before)
        return [(state, on_device[state_before.device]) for state, state_before in zip(states, before)]


# Families (text model types) whose recurrent layers carry their states through a forward of several tokens on a
# filled cache exactly as through one forward over the whole sequence, which verifying drafts needs. Checked for each
# by tests/test_recurrent_targets.py. transformers' Mamba, FalconMamba, Jamba and Bamba start such a forward from
# empty states (their scan takes no initial state), so they cannot verify drafts.
RECURRENT_TARGETS = frozenset(
    {
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "qwen3_next",
        "olmo_hybrid",
        "kimi_linear",
        "bailing_hybrid",
        "nemotron_h",
        "falcon_h1",
        "granitemoehybrid",
        "mamba2",
    }
)


# Layer types whose cache layers hold a recurrent state; a "conv" layer (LFM2's) keeps a window that crops as keys do.
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "hybrid", "hybrid_sliding"})
# Families whose "hybrid" and "hybrid_sliding" cache layers hold short-convolution windows beside keys and values and
# no recurrent state (their modeling code never writes one), so they crop as LFM2's "conv" layers do.
CONVOLUTION_WINDOW_TARGETS = frozenset({"inkling_text", "inkling2_text", "inkling2_loop_text"})


def keeps_recurrent_states(target) -> bool:
    """Whether `target` keeps recurrent states (linear attention, state-space layers), which cannot drop a
    verification's rejected drafts the way keys and values are cropped: `_is_stateful` where transformers marks it,
    else its layer types."""
    if not TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES:
        return bool(getattr(target, "_is_stateful", False))
    text_config = target.config.get_text_config(decoder=True)
    if text_config.model_type in CONVOLUTION_WINDOW_TARGETS:
        return False
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    return not RECURRENT_LAYER_TYPES.isdisjoint(layer_types)


def check_recurrent_target(target) -> None:
    """Raises, naming the fix, for a target with recurrent states that drafting cannot serve exactly."""
    model_type = target.config.get_text_config().model_type
    if model_type not in RECURRENT_TARGETS:
        raise ValueError(
            f"{type(target).__name__} keeps recurrent states, and {model_type} is not among the families whose forward "
            "over several tokens of a filled cache was checked to continue them exactly, which verifying drafts needs "
            f"({', '.join(sorted(RECURRENT_TARGETS))}): generate without the drafter."
        )


def has_recurrent_layers(cache: Cache | None) -> bool:
    """Whether `cache` holds layers with recurrent states (linear attention, state-space models)."""
    return cache is not None and any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


@contextlib.contextmanager
def recurrent_state_check_waived(target):
    """transformers < 5.25 refuses an assistant for a target with recurrent states (`_is_stateful`), which cannot
    drop rejected drafts; a Domino call rolls them back (`RecurrentRollback`) for the families that continue their
    states exactly over a forward of several tokens (`check_recurrent_target`, else refused here, on every release),
    and refuses before the prefill a call whose cache or shape does not let it (`check_recurrent_call`)."""
    if not keeps_recurrent_states(target):
        yield
        return
    check_recurrent_target(target)
    if TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES:  # no such refusal to waive
        yield
        return
    target.__dict__["_is_stateful"] = False  # this instance, for transformers' check only
    try:
        yield
    finally:
        target.__dict__.pop("_is_stateful", None)


def check_recurrent_call(target, cache, generation_config, batched: bool, branches: int = 1) -> None:
    """Raises, naming the fix, for a call on a target with recurrent states that a Domino drafter cannot serve."""
    if batched and branches > 1:
        raise ValueError(
            f"{type(target).__name__} keeps per-layer states (linear attention, convolution or state-space layers), "
            "which a tree of first-token branches cannot keep per branch: draft plain blocks (domino_branches=1)."
        )
    if batched and keeps_recurrent_states(target) and not has_replayable_scan(target):
        raise ValueError(
            f"{type(target).__name__} keeps per-layer states that a drafted batch cannot keep row by row (only "
            "families whose scan can be replayed over each row's kept tokens can: the Gated DeltaNet and Mamba2 "
            "ones): generate one sequence at a time with the drafter, or the batch without it."
        )
    if batched and cached_tokens(cache):
        raise ValueError(
            f"A drafted batch of {type(target).__name__} starts from its prompts: its linear-attention states hold no "
            "count of their tokens per row. Pass the whole conversations without the cache, or one sequence at a "
            "time."
        )
    if not has_recurrent_layers(cache):
        raise ValueError(
            f"{type(target).__name__} keeps its recurrent states outside a cache of linear-attention layers passed "
            f"through generate() (got {type(cache).__name__}), where drafting cannot roll them back after a rejected "
            "draft (transformers 5.24 moved state-space models' states there): upgrade transformers, or generate "
            "without the drafter."
        )
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        raise ValueError(
            f"With a drafter, {type(target).__name__}'s forwards may read again the tokens of a verification rolled "
            "back whole (its recurrent states cannot drop rejected drafts where the scan kept no inputs, as in a "
            "compiled forward), so they return no attentions or hidden states per generated token: drop "
            "output_attentions/output_hidden_states (output_scores and output_logits work)."
        )


__all__ = [
    "RECURRENT_TARGETS",
    "RecurrentRollback",
    "SCAN_FAMILIES",
    "TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES",
    "check_recurrent_call",
    "check_recurrent_target",
    "has_recurrent_layers",
    "has_replayable_scan",
    "keeps_recurrent_states",
    "record_past",
    "recurrent_state_check_waived",
    "replayable_scan",
]
