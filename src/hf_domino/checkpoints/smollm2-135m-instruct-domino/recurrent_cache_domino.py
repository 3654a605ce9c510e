"""How a cache with recurrent layers (linear attention, state-space models) gives back a verification's rejected
drafts: `RecurrentRollback` keeps the states each forward started from and, where the family's scan allows, the inputs
it read, so that a state holds exactly the tokens kept; which targets keep such states (`keeps_recurrent_states`) and
which of them can verify drafts at all (`check_recurrent_target`), and which calls on them a drafter serves
(`check_recurrent_call`).

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs

from .recurrent_scans_domino import (
    RULE_INPUT_TOKENS,
    ScanFamily,
    expect_scan_inputs,
    has_replayable_scan,
    replayable_scan,
    take_scan_inputs,
)

# transformers >= 5.25 rolls recurrent states back in its own assisted loop (per-token states kept by each forward),
# and no longer marks the models that keep them `_is_stateful`, which earlier releases refuse an assistant for.
TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES = (
    "recurrent_states_to_keep" in inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
)


def _keep_state_before(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
    """`update_recurrent_state` of a snapshot layer: the new state is kept by reference rather than copied into the
    old one's storage, so the state the forward started from survives as it was, with no copy per forward. The
    inputs the scan just read (this layer's: layers run one after another) go with it."""
    self.inputs_before[state_idx] = take_scan_inputs()  # None: no scan recorded for this layer
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
            "built_class": layer_class,
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

    # What `remove` leaves in the layers' `record_past`: transformers' assisted loop leaves it set.
    leaves_recording = True

    def __init__(self, cache: Cache, committed: int, scan: ScanFamily | None = None):
        """Makes the cache's linear-attention layers snapshot layers until `remove`."""
        self.cache, self.committed, self.fed = cache, committed, 0
        self.scan = scan
        self.started = True  # read by a batch's forwards only (`before_rows_forward`)
        self.widest = RULE_INPUT_TOKENS  # the widest forward whose scan inputs are recorded (`_expect_forward`)
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
    def install_for_rows(
        cls, cache: Cache, target, started: bool = False, widest: int = RULE_INPUT_TOKENS
    ) -> RecurrentRollback:
        """For a batch (`ragged_cache_domino.RaggedCache`, which crops its attention layers itself): each row keeps
        what it accepted (`keep_rows`). Families with a replayable scan only, whose states can be kept in part. The
        first forward (the prompt's, on a cache filled before or not) is never kept in part unless `started`; those
        of more than `widest` columns never are."""
        rollback = cls(cache, 0, replayable_scan(target))
        rollback.started, rollback.widest, rollback.leaves_recording = started, widest, False  # as generate() does
        return rollback

    def remove(self) -> None:
        """The cache as it was built, holding what the call left in it."""
        expect_scan_inputs(None)
        for layer, layer_class in zip(self.layers, self.classes):
            layer.__class__ = layer_class
            layer.record_past = self.leaves_recording
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
        expect_scan_inputs(self.widest if verifying and self.scan is not None else None)
        for layer in self.layers:
            layer.states_before, layer.inputs_before = {}, {}
            layer.record_past = verifying

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop after a verification: nothing rejected keeps the forward; with rejected drafts, the
        states after the verified tokens where the scan's inputs were kept, else the whole forward rolled back (the
        tokens it verified are read again by the next one)."""
        expect_scan_inputs(None)
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

    def before_rows_forward(self, width: int) -> None:
        """A batch's forward of `width` columns per row: kept in part later (its scan inputs recorded, its convolution
        history kept) unless it is one column (the in-place step) or the call's first forward (never rolled back)."""
        self._expect_forward(width, verifying=width > 1 and self.started)
        self.started = True

    def keep_rows(self, kept: torch.LongTensor) -> None:
        """After a batch's verification, row b keeps the first `kept[b]` of the columns the forward read: its
        recurrent states become the scan over those (rows grouped by count; a row that kept every column keeps the
        forward's, one that kept none the state it started from), its convolution window ends after them. Holes of
        shorter rows come after their tokens, so they are never among the kept. Layers of convolutions only (LFM2's)
        have no states to recompute."""
        expect_scan_inputs(None)
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
            if count == 0:
                for layer in self.layers:
                    state = layer.recurrent_states[0]
                    state[rows.to(state.device)] = layer.states_before[0][rows.to(state.device)].to(state.dtype)
                continue
            for layer, (state, rows_there) in zip(self.layers, self._states_after(inputs, count, rows)):
                layer.recurrent_states[0][rows_there] = state.to(layer.recurrent_states[0].dtype)

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


def rolls_back(cache: Cache | None, target) -> bool:
    """Whether a forward on `cache` is given back through `RecurrentRollback` rather than by cropping: its layers
    keep recurrent states, which no crop can drop (Inkling's linear-attention layers keep only convolution windows,
    which crop: `CONVOLUTION_WINDOW_TARGETS`)."""
    return has_recurrent_layers(cache) and keeps_recurrent_states(target)


# The tensors of a linear-attention cache layer with an entry per row and none per token, each per state index: its
# convolution windows and its recurrent states.
ROW_STATES = ("conv_states", "recurrent_states")
# What a linear-attention cache layer records per state index besides them: how it was set up.
_PER_STATE_INDEX = ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                    "conv_kernel_size")  # fmt: skip


def row_states(layer: Any) -> dict[tuple[str, int], torch.Tensor]:
    """The tensors `layer` holds per row and not per token (`ROW_STATES`), by name and state index; none where it is
    not a linear-attention layer or holds none yet."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return {}
    return {
        (name, index): state for name in ROW_STATES for index, state in getattr(layer, name).items()
        if state is not None
    }  # fmt: skip


def put_row_states(layer: Any, states: dict[tuple[str, int], torch.Tensor]) -> None:
    """`layer` holding these tensors (`row_states`' kind) in place of its own."""
    for (name, index), state in states.items():
        getattr(layer, name)[index] = state


def select_state_rows(layer: Any, rows: torch.LongTensor) -> None:
    """Keeps only these rows of `layer`'s per-row states (finished rows leave a batch); nothing for other layers."""
    put_row_states(layer, {key: state[rows.to(state.device)] for key, state in row_states(layer).items()})


def add_state_rows(layer: Any, other: Any) -> None:
    """Appends the per-row states of `other` (a layer of the same model, filled apart) after `layer`'s rows; a layer
    that never held any (a server's batch before its first request) takes `other`'s set-up with them."""
    mine, theirs = row_states(layer), row_states(other)
    if not theirs:
        return
    if not mine:
        for name in _PER_STATE_INDEX:
            getattr(layer, name).update(getattr(other, name))
        layer.device, layer.dtype = other.device, other.dtype
    put_row_states(
        layer, {key: torch.cat([mine[key], state]) if key in mine else state for key, state in theirs.items()}
    )


def layer_for_rows(layer: LinearAttentionCacheLayerMixin) -> LinearAttentionCacheLayerMixin:
    """A new cache layer of `layer`'s class as built (a drafting call swaps in a snapshot class) and set up as it is
    (which states it initialized, its kernel sizes, its device), to hold copies of some of its rows' states
    (`put_row_states`) and, for a layer with attention beside them, their columns."""
    fresh = copy.copy(layer)
    fresh.__class__ = getattr(type(layer), "built_class", type(layer))
    for name in (*ROW_STATES, *_PER_STATE_INDEX):
        setattr(fresh, name, dict(getattr(layer, name)))
    if hasattr(layer, "cumulative_length_linear"):  # transformers >= 5.25
        fresh.cumulative_length_linear = layer.cumulative_length_linear.clone()
    for name in ("states_before", "inputs_before", "recurrent_states_history"):
        fresh.__dict__.pop(name, None)
    fresh.record_past = False
    return fresh


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
    "TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES",
    "add_state_rows",
    "check_recurrent_call",
    "check_recurrent_target",
    "has_recurrent_layers",
    "rolls_back",
    "keeps_recurrent_states",
    "layer_for_rows",
    "put_row_states",
    "record_past",
    "recurrent_state_check_waived",
    "row_states",
    "select_state_rows",
]
