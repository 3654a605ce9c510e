"""The linear layer of the CPU fast path: `PrepackedLinear` multiplies by a oneDNN-prepacked copy of its weight.

Why: on a CPU, eager `nn.Linear` hands each product to MKL's sgemm, which packs the weight matrix again on every call
with more than one row. A forward over 2-3 tokens (a verification of 1-2 drafts) then costs 1.6-2.0x a single-token
forward, and the target's 49152-row LM head over 2-3 rows costs 4-5x its single row (docs/benchmarks.md, "Why two
tokens cost more than eight"). oneDNN, which torch ships, can pack a weight once, in the layout its matmul kernel
reads (`torch.ops.mkldnn._reorder_linear_weight`, the op torch.compile's CPU weight freezing uses), and multiply any
number of rows by it (`torch.ops.mkldnn._linear_pointwise`). Measured on this project's 2-core CPU, that makes a
forward over 2-3 tokens cost about 1.1x a single one, and the 8192-row draft-vocabulary LM head over 3 positions
0.2 ms instead of 1.8.

Not on every CPU, though: where MKL multiplies a few rows without packing again (a later machine of this project, AMX
and torch 2.13: `F.linear` faster at 1-3 rows for every weight shape, up to 17 for some), packing everything made the
target alone slower than not preparing it. So preparing also times both products per weight shape at 1-17 rows and
keeps `F.linear` where it measured faster (`measure_linear_dispatch`).

A `PrepackedLinear` is an `nn.Linear` whose class `prepare_for_cpu_decoding` swapped in place (its parameters are
the same objects). So:

- `weight` and `bias` stay the module's dense parameters, the same objects (a packed weight's class becomes
  `WatchedParameter`, an `nn.Parameter`): tied weights stay tied, `state_dict()`/`save_pretrained()` and loading are
  unchanged, and the drafter still reads the target's LM head and embedding table;
- the packed copy is derived data, rebuilt whenever the weight changes (assignment, in-place update, an update
  through `.data`, which `WatchedParameter` counts, `.to()`), never saved or copied (deep copies and pickles drop
  it), and costs a second copy of each weight in memory;
- the product is `F.linear` at the row counts where that measured faster here, and where the packed one does not
  apply: inputs not on the CPU, autograd (training), an input dtype unlike the weight's, dtypes oneDNN cannot pack on
  this CPU (fp16 without avx512_fp16), inference tensors (made under `torch.inference_mode()`: they have no version
  counter, so an in-place update of one could not be seen), inside `eager_linears()`, and inside a compiled forward
  (generate() on a static cache with a compile config), whose products inductor chooses;
- `rows_linear(x, rows)` multiplies by the rows `rows` of the weight only, packed once per row set: the drafter's
  draft-vocabulary LM head (`TargetModules.logits`) and head correction use it when the module offers it.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# Row sets of `rows_linear` kept packed per module (a draft vocabulary or two per drafter/target pair).
MAX_ROW_SETS = 4
_EAGER = contextvars.ContextVar("hf_domino_eager_linears", default=False)


class WatchedParameter(nn.Parameter):
    """A packed weight: an `nn.Parameter` that counts the times it hands out `.data`.

    `.data` gives the weight's values with a version counter of their own, so an update through it (PEFT's merge of a
    LoRA adapter, `weight.data += delta`; an edit of a tied embedding's rows) leaves `weight._version` as it was, and a
    packed copy checked by version alone was read stale: the prepared model answered with its old weights. Every
    `.data` is taken for a possible write (the next product packs again); nothing in a decoding step asks for it.
    """

    data_handed_out = 0  # per weight once it has handed out `.data`

    @property
    def data(self) -> torch.Tensor:
        self.data_handed_out += 1
        return nn.Parameter.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self.data_handed_out += 1
        nn.Parameter.data.__set__(self, value)


def _weight_key(weight: torch.Tensor) -> tuple:
    """Changes whenever the weight's values may have: a new tensor, an in-place update (of the weight, or through its
    `.data` once watched), a new dtype or device."""
    version = -1 if weight.is_inference() else weight._version  # inference tensors have no version counter
    handed_out = getattr(weight, "data_handed_out", 0)
    return (weight.data_ptr(), version, handed_out, weight.dtype, weight.device, tuple(weight.shape))


def _watch(weight: torch.Tensor) -> bool:
    """Makes a plain `nn.Parameter` a `WatchedParameter` (the same object); whether `weight` is watched now. Other
    tensors (another library's parameter class, a plain tensor) are not packed: their `.data` could not be seen."""
    if type(weight) is nn.Parameter:
        weight.__class__ = WatchedParameter
    return type(weight) is WatchedParameter


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN can prepack on this CPU: float32, and bfloat16/float16 where the CPU supports them."""
    if not torch.backends.mkldnn.is_available():
        return ()
    dtypes = [torch.float32]
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.append(torch.bfloat16)
    # The fp16 reorder needs avx512_fp16 or avx_ne_convert, which _is_mkldnn_fp16_supported does not check.
    with contextlib.suppress(RuntimeError, NotImplementedError):
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(1, 1, dtype=torch.float16), None)
        dtypes.append(torch.float16)
    return tuple(dtypes)


class PrepackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies by a oneDNN-prepacked copy of its weight on a CPU (see the module docstring).

    Made by `prepare_for_cpu_decoding`, which swaps the class of existing `nn.Linear` modules; `weight` and `bias`
    remain the module's own dense parameters.
    """

    _packed: tuple[tuple, nn.Parameter, torch.Tensor] | None = None  # (`_weight_key`, the weight, its packed copy)
    _row_sets: dict | None = None
    # Row counts (tokens x sequences) that `F.linear` multiplies faster than the packed product on this CPU, and the
    # weight dtype and shape they were measured for (`measure_linear_dispatch`); empty: always packed.
    _eager_rows: frozenset[int] = frozenset()
    _eager_rows_for: tuple | None = None

    def _packs(self, x: torch.Tensor) -> bool:
        weight = self._parameters.get("weight")  # absent under a parametrization (weight_norm, ...): computed anew
        return (
            weight is not None
            and "bias" in self._parameters
            and not _EAGER.get()
            and x.device.type == "cpu"
            and weight.device.type == "cpu"
            and x.dtype == weight.dtype
            and weight.dtype in PACKABLE_DTYPES
            and not weight.is_inference()
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and _watch(weight)  # a plain Parameter is watched from its first packing on
        )

    def packed_weight(self) -> torch.Tensor:
        """The weight in oneDNN's packed layout, packed again if the weight changed since."""
        weight = self.weight
        _watch(weight)
        key = _weight_key(weight)
        if self._packed is None or self._packed[0] != key:
            # Also the Parameter itself, for `forward`'s short check: the same object, storage, version and count of
            # `.data` handed out hold the same values (new data moves the storage, in-place changes the version, an
            # update through `.data` the count, assignment the object).
            self._packed = (key, weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
            if self._eager_rows and self._eager_rows_for != (weight.dtype, tuple(weight.shape)):
                self._eager_rows = frozenset()  # measured for another dtype or shape: packed until measured again
        return self._packed[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # A compiled forward (generate() on a static cache with a compile config) is inductor's to plan: tracing
            # the checks below would break its graph in every layer and recompile it for every module.
            return F.linear(x, self.weight, self.bias)
        # A decoding step of a small model makes ~200 of these calls, so the usual case reads as few attributes as it
        # can: the weight packed at this version of this tensor, an input like it, no autograd (`_packs` in short).
        weight, packed = self._parameters.get("weight"), self._packed
        if (
            packed is not None
            and packed[1] is weight
            and packed[0][1] == (-1 if weight.is_inference() else weight._version)  # `_weight_key`'s version
            and packed[0][2] == weight.data_handed_out
            and packed[0][0] == weight.data_ptr()
            and "bias" in self._parameters  # not under a parametrization since
            and x.dtype == weight.dtype
            and x.is_cpu
            and not _EAGER.get()
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        ):
            if self._eager_rows and x.numel() // x.shape[-1] in self._eager_rows:
                return F.linear(x, weight, self._parameters["bias"])
            return torch.ops.mkldnn._linear_pointwise(x, packed[2], self._parameters["bias"], "none", [], "")
        if not self._packs(x):
            return F.linear(x, self.weight, self.bias)
        packed_weight = self.packed_weight()  # first: a weight of a new dtype or shape drops the measured rows
        if self._eager_rows and x.numel() // x.shape[-1] in self._eager_rows:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, self.bias, "none", [], "")

    def _product_seconds(self, rows: int) -> tuple[float, float]:
        """The fastest of a few `F.linear` and packed products over `rows` rows: (eager, packed) seconds."""
        weight, bias = self.weight, self.bias
        x = torch.randn(1, rows, self.in_features, dtype=weight.dtype)
        packed = self.packed_weight()
        eager, packed_product = _fastest_of_each(
            lambda: F.linear(x, weight, bias),
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
        )
        return eager, packed_product

    def rows_linear(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`F.linear(x, weight[rows], bias[rows])`: the outputs `rows` only (a draft vocabulary's logits)."""
        weight, bias = self.weight, self.bias
        if not self._packs(x):
            return F.linear(x, weight[rows.to(weight.device)], None if bias is None else bias[rows.to(weight.device)])
        # Each entry keeps its `rows` tensor alive, so no other tensor can take its address while the entry exists.
        key = (_weight_key(weight), _weight_key(rows))
        row_sets = self._row_sets if self._row_sets is not None else {}
        entry = row_sets.get(key)
        if entry is None:
            if len(row_sets) >= MAX_ROW_SETS:
                row_sets.clear()
            index = rows.to(weight.device)
            entry = row_sets[key] = (
                rows,
                torch.ops.mkldnn._reorder_linear_weight(weight.detach()[index].contiguous(), None),
                None if bias is None else bias.detach()[index].contiguous(),
            )
            self._row_sets = row_sets
        return torch.ops.mkldnn._linear_pointwise(x, entry[1], entry[2], "none", [], "")

    def packed_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() if self._packed is not None else 0

    def __getstate__(self) -> dict[str, Any]:
        # Packed oneDNN tensors can be neither copied nor pickled; they are rebuilt at the next product.
        state = dict(super().__getstate__())
        state.pop("_packed", None)
        state.pop("_row_sets", None)
        return state


# The dtypes this CPU packs, asked once per process.
PACKABLE_DTYPES = packable_dtypes()

# Row counts at which `measure_linear_dispatch` times both products of each weight shape: a decoding step's single
# token and a verification's 1 + k, up to a whole block. Larger products stay packed (where packing pays most).
DISPATCH_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 17)
# `F.linear` keeps a row count only where it measured at least this much faster (near-ties stay packed).
EAGER_MARGIN = 0.9
# Seconds of repeats per product timed; at least 3 rounds, the fastest kept (other work only ever adds time).
TIMING_BUDGET = 0.004


def _fastest_of_each(*products) -> list[float]:
    """The fastest of a few runs of each product, interleaved round by round so that other work on the machine slows
    them alike (a burst during one product's runs only would decide for the other)."""
    for product in products:
        product()  # warm-up: first-touch allocations, kernel selection
    start = time.perf_counter()
    for product in products:
        product()
    rounds = max(3, min(20, int(TIMING_BUDGET * len(products) / max(time.perf_counter() - start, 1e-6))))
    fastest = [float("inf")] * len(products)
    for _ in range(rounds):
        for index, product in enumerate(products):
            start = time.perf_counter()
            product()
            fastest[index] = min(fastest[index], time.perf_counter() - start)
    return fastest


@torch.no_grad()
def measure_linear_dispatch(
    modules: list[PrepackedLinear], measured: dict[tuple, frozenset[int]] | None = None
) -> dict[tuple, frozenset[int]]:
    """Times `F.linear` against the packed product once per weight shape among `modules`, at each of `DISPATCH_ROWS`
    rows (at this process's thread count), and lets each module multiply eagerly at the row counts where that
    measured faster. Returns the eager row counts by `(out_features, in_features, dtype)`.

    Which is faster depends on the CPU and the shape: on the 2-core machines of docs/benchmarks.md, MKL's sgemm packed
    the weight again for every product over 2-3 rows (1.6-2x a single row), and packing once won everywhere; on a
    later one (AMX, torch 2.13) `F.linear` was faster up to 3-17 rows depending on the shape, and the packed LM head
    still won. Row counts between two that measured eager are eager too; others stay packed. Shapes already in
    `measured` (a drafter sharing its target's) take that decision without timing it again.
    """
    by_shape: dict[tuple, list[PrepackedLinear]] = {}
    for module in modules:
        by_shape.setdefault((module.out_features, module.in_features, module.weight.dtype), []).append(module)
    dispatch = {}
    for shape, group in by_shape.items():
        if measured is not None and shape in measured:
            dispatch[shape] = measured[shape]
        else:
            eager = [rows for rows in DISPATCH_ROWS if _is_faster(*group[0]._product_seconds(rows))]
            filled = {r for low, high in zip(eager, eager[1:]) if _adjacent(low, high) for r in range(low, high + 1)}
            dispatch[shape] = frozenset(eager) | frozenset(filled)
        for module in group:
            module._eager_rows = dispatch[shape]
            module._eager_rows_for = (module.weight.dtype, tuple(module.weight.shape))
    return dispatch


def _is_faster(eager_seconds: float, packed_seconds: float) -> bool:
    return eager_seconds < EAGER_MARGIN * packed_seconds


def _adjacent(low: int, high: int) -> bool:
    """Whether no measured row count lies between `low` and `high` (both measured)."""
    return DISPATCH_ROWS.index(high) == DISPATCH_ROWS.index(low) + 1


@contextlib.contextmanager
def eager_linears() -> Iterator[None]:
    """Inside this block, prepared linear layers multiply with plain `F.linear` (e.g. to time the eager path)."""
    token = _EAGER.set(True)
    try:
        yield
    finally:
        _EAGER.reset(token)


__all__ = [
    "DISPATCH_ROWS",
    "PACKABLE_DTYPES",
    "PrepackedLinear",
    "WatchedParameter",
    "eager_linears",
    "measure_linear_dispatch",
    "packable_dtypes",
]
