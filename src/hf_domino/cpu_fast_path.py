"""A one-line CPU fast path for decoding: `prepare_for_cpu_decoding(target, drafter)`.

What it changes, on models whose parameters are all on the CPU (a CUDA model is left as it is): every module of
exact type `nn.Linear` (the LM head included) becomes a `PrepackedLinear` in place, which multiplies by a
oneDNN-prepacked copy of its weight where that measured faster than `F.linear` on this CPU (prepacked_linear.py:
why, and what stays as it was: a verification of 2-3 tokens then costs about one single-token step).

Attention over grouped key/value heads (SmolLM2: 3 key/value heads for 9 query heads) switches from transformers'
`sdpa` to `sdpa_grouped_kv` (registered here), the same function except in one case: a masked attention over several
queries, i.e. a verification of drafts (or a batch). There `sdpa` copies every key/value head of the whole cache
once per query head of its group (`repeat_kv`) before each layer's attention, because masked grouped attention falls
back to a slow kernel on CUDA; torch's CPU kernel reads the groups in place (`enable_gqa`) with a bit-identical
result (tested; from torch 2.9 on, so older releases keep the copies), 1-2 ms less per verification of the 135M
target at a few hundred tokens of context. A batch's verification (2 to 8 queries per row, 2 rows or more) runs as
two matmuls per key/value head instead (`grouped_matmul_attention`), which reads each key/value head once for all its
query heads: 1.3-1.8x faster attention there, equal to `sdpa` up to fp32 rounding.

The drafter is also cast to the target's dtype when they differ: an fp16 drafter (the dtype of the shipped
checkpoint, what `from_pretrained` gives by default) multiplies on a CPU without packed fp16 kernels several times
slower than in fp32, and every draft then pays a cast of the target's features.

Given a Domino drafter, it also measures what the prepared target's forwards over 1-17 tokens cost (the adaptive
policy's verify-cost table, kept for the process), which the first `generate()` with the drafter would otherwise do:
with the datastore's index built at load, a process's first call pays nothing its later calls do not.

`compile=True` goes one step further: the target's generate() then compiles its forward on a static cache, on the CPU
too (transformers compiles only on GPUs unless told), and the packed products inside that forward are plain linears
for inductor to plan. On this project's CPU that made the default drafter 1.32-1.37x the compiled target alone and
1.71-1.85x the target as it runs by default, after minutes of compiling (docs/benchmarks.md, "Compiled on a CPU").

Calling it again changes nothing (already prepared modules are counted, not repacked). Greedy output is the prepared
target's own, token for token: speculative decoding verifies every draft with the same (prepared) target. Against
the eager target alone, fp32 products agree to rounding (a different summation order), like any change of kernel.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface, CompileConfig, GenerationConfig
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import is_torch_greater_or_equal

from .prepacked_linear import (
    PACKABLE_DTYPES,
    PrepackedLinear,
    WatchedParameter,
    eager_linears,
    measure_linear_dispatch,
    packable_dtypes,
)
from .target_modules_domino import dense_weight, execution_device, offload_hooked

logger = logging.getLogger(__name__)


@dataclass
class CpuFastPathReport:
    """What `prepare_for_cpu_decoding` did, per model ("target", "drafter")."""

    prepacked: dict[str, list[str]] = field(default_factory=dict)  # modules made prepacked by this call
    already: dict[str, int] = field(default_factory=dict)  # modules already prepacked by an earlier call
    skipped: dict[str, str] = field(default_factory=dict)  # model -> why it was left untouched
    hooked: dict[str, int] = field(default_factory=dict)  # nn.Linear left to accelerate's hooks (offloading)
    casts: list[str] = field(default_factory=list)
    attention: list[str] = field(default_factory=list)  # models switched to GROUPED_KV_ATTENTION by this call
    compiled: bool = False  # generate() compiles the target's forward on a static cache (`compile=True`)
    packed_bytes: int = 0  # memory taken by the packed copies made by this call
    verify_ms: dict[int, float] = field(default_factory=dict)  # the prepared target's forward over n tokens, in ms
    # model -> weight shape -> row counts multiplied with F.linear, where it measured faster (`measure_linear_dispatch`)
    eager_rows: dict[str, dict[tuple, frozenset[int]]] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.casts or self.attention or self.compiled or any(self.prepacked.values()))

    def __str__(self) -> str:
        parts = []
        for name in sorted(set(self.prepacked) | set(self.already) | set(self.skipped)):
            if name in self.skipped:
                done = (
                    f"{GROUPED_KV_ATTENTION} attention, no nn.Linear prepacked"
                    if name in self.attention
                    else "untouched"
                )
                parts.append(f"{name}: {done} ({self.skipped[name]})")
                continue
            new, old = len(self.prepacked.get(name, [])), self.already.get(name, 0)
            part = f"{name}: {new} nn.Linear prepacked for oneDNN" + (f" ({old} already were)" if old else "")
            if self.hooked.get(name):
                part += f" ({self.hooked[name]} under accelerate's offloading hooks left as they are)"
            if name in self.attention:
                part += f", {GROUPED_KV_ATTENTION} attention"
            part += _dispatch_summary(self.eager_rows.get(name))
            parts.append(part)
        parts += self.casts
        if self.compiled:
            parts.append("generate() compiles the target's forward on a static cache (its first calls compile)")
        if self.packed_bytes:
            parts.append(f"{self.packed_bytes / 2**20:.0f} MiB of packed weights")
        if self.verify_ms:
            tokens, ms = "/".join(map(str, self.verify_ms)), "/".join(f"{t:.1f}" for t in self.verify_ms.values())
            parts.append(f"verifying {tokens} tokens costs {ms} ms")
        return "; ".join(parts) if parts else "nothing to prepare"


def _dispatch_summary(dispatch: dict[tuple, frozenset[int]] | None) -> str:
    if not dispatch:
        return ""
    eager = [rows for rows in dispatch.values() if rows]
    if not eager:
        return " (every product measured faster packed)"
    return (
        f" ({len(eager)} of {len(dispatch)} weight shapes multiply up to {max(map(max, eager))} rows with F.linear, "
        "measured faster here)"
    )


# The attention implementation `prepare_for_cpu_decoding` gives models with grouped key/value heads on the CPU.
GROUPED_KV_ATTENTION = "sdpa_grouped_kv"


# A batch's masked attention over 2 to this many queries per row (its verifications) runs as two matmuls per key/value
# head (`grouped_matmul_attention`); one sequence's, a prefill's and single-token steps keep torch's fused kernel, which
# is as fast or faster there (`examples/grouped_kv_attention.py`).
MATMUL_MAX_QUERIES = 8

# torch's fused CPU kernel reads grouped key/value heads in place bit for bit as over `repeat_kv`'s copies from torch
# 2.9 on; torch 2.6-2.8 round differently (2.6.0: up to 3e-7 in fp32 for one sequence at SmolLM2's heads,
# examples/grouped_kv_attention.py; 2.7.1 and 2.8.0 differ too), so there one sequence's masked attention stays sdpa's.
GROUPED_KV_IN_PLACE = is_torch_greater_or_equal("2.9", accept_dev=True)


def grouped_matmul_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of `query` `[rows, heads, q, d]` over grouped `key`/`value` `[rows, kv_heads, n, d]` under a boolean
    `mask` `[rows, 1, q, n]` (True: attend), as two batched matmuls per key/value head over the queries of all its
    query heads.

    torch's fused CPU kernel walks the keys once per query block of every query head, so a verification of a few
    drafts in a batch (4 rows x 2 queries over a few hundred keys) spends most of its time re-reading them; stacking
    a group's query heads makes one pass over a key/value head serve all of them (1.3-1.8x faster attention at 2-8
    rows and 2-5 queries on this project's CPU; docs/benchmarks.md, "Batched verification's attention"). Same result
    up to fp32 rounding (the softmax is not the fused kernel's online one).
    """
    rows, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(query.reshape(rows, kv_heads, group * queries, dim), key.transpose(-1, -2))
    scores = scores.mul_(scaling).view(rows, kv_heads, group, queries, keys)
    # The lowest finite value, not -inf: a query that may see no key (left padding in a short prompt) gets finite
    # weights, not NaN that would spread through the values of every later layer.
    scores.masked_fill_(~mask.unsqueeze(2), torch.finfo(scores.dtype).min)
    weights = scores.softmax(dim=-1).view(rows, kv_heads, group * queries, keys)
    return torch.matmul(weights, value).view(rows, heads, queries, dim)


def sdpa_grouped_kv_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, except that on a CPU a masked attention over several queries reads
    grouped key/value heads in place instead of repeating them (see the module docstring), as matmuls per key/value
    head (`grouped_matmul_attention`) for a batch's few queries per row (its verifications)."""
    rows, _, queries, _ = query.shape
    reads_groups = not (
        attention_mask is None
        or queries == 1
        or query.device.type != "cpu"
        or getattr(module, "num_key_value_groups", 1) == 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    )
    if (
        reads_groups
        and rows > 1
        and queries <= MATMUL_MAX_QUERIES
        and query.dtype == torch.float32  # a low-precision softmax would round unlike the fused kernel's fp32 one
        and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and not (dropout and getattr(module, "training", False))
    ):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        output = grouped_matmul_attention(query, key, value, attention_mask, scale)
        return output.transpose(1, 2).contiguous(), None
    if reads_groups and GROUPED_KV_IN_PLACE:
        # With a mask `sdpa` is never causal either: the mask says it all.
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return output.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


AttentionInterface.register(GROUPED_KV_ATTENTION, sdpa_grouped_kv_forward)
AttentionMaskInterface.register(GROUPED_KV_ATTENTION, sdpa_mask)


def _use_grouped_kv_attention(model: nn.Module, name: str, report: CpuFastPathReport) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not _groups_key_value_heads(config):
        return
    model.set_attn_implementation(GROUPED_KV_ATTENTION)
    report.attention.append(name)


def _groups_key_value_heads(config) -> bool:
    """Whether some layer has fewer key/value heads than query heads; read per layer where transformers keeps head
    counts per layer (dots.llm3's), since the grouped forward passes ungrouped layers on to `sdpa` as they are. A
    multimodal model's are its text config's (Gemma 3's `Gemma3ForConditionalGeneration`)."""
    config = config.get_text_config()
    layers = [config]
    if getattr(config, "per_layer_config", None) is not None:
        layers = [config.per_layer_config[index] for index in range(config.num_hidden_layers)]
    for layer in layers:
        heads = getattr(layer, "num_attention_heads", None)
        if heads and (getattr(layer, "num_key_value_heads", None) or heads) != heads:
            return True
    return False


def _devices(model: nn.Module) -> set[str]:
    """The device types `model` computes on. Weights accelerate offloaded (`device_map` with "cpu" or "disk" parts,
    `accelerate.cpu_offload`) wait on the meta device, and their modules' hooks bring them to where they compute for
    each forward."""
    return {
        (execution_device(module) if tensor.device.type == "meta" else tensor.device).type
        for module in model.modules()
        for tensor in module.parameters(recurse=False)
    }


def _on_cpu(model: nn.Module) -> bool:
    return _devices(model) == {"cpu"}


def _prepare(model: nn.Module, name: str, report: CpuFastPathReport, measure_products: bool) -> None:
    if not PACKABLE_DTYPES:
        report.skipped[name] = "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
        return
    if not _on_cpu(model):
        report.skipped[name] = f"on {', '.join(sorted(_devices(model) - {'cpu'}))}, not the CPU"
        return
    _use_grouped_kv_attention(model, name, report)
    prepared, already = [], 0
    for module_name, module in model.named_modules():
        if isinstance(module, PrepackedLinear):
            already += 1
        elif type(module) is nn.Linear and offload_hooked(module):
            report.hooked[name] = report.hooked.get(name, 0) + 1
        elif type(module) is nn.Linear and _plain_float(module.weight):
            module.__class__ = PrepackedLinear
            with torch.no_grad():
                module.packed_weight()
            report.packed_bytes += module.packed_bytes()
            prepared.append(module_name)
    report.prepacked[name], report.already[name] = prepared, already
    if prepared and measure_products:
        modules = dict(model.named_modules())
        measured = {shape: rows for dispatch in report.eager_rows.values() for shape, rows in dispatch.items()}
        report.eager_rows[name] = measure_linear_dispatch([modules[n] for n in prepared], measured)
    if not prepared and not already and not report.hooked.get(name):
        inference = any(type(m) is nn.Linear and m.weight.is_inference() for m in model.modules())
        report.skipped[name] = (
            "its weights are inference tensors (made under torch.inference_mode()), whose in-place updates a packed "
            "copy could not follow: build or load the model outside inference mode"
            if inference
            else f"no nn.Linear of a dtype oneDNN packs here ({', '.join(map(str, PACKABLE_DTYPES))}); quantized "
            "weights are left as they are"
        )


def _plain_float(weight: torch.Tensor) -> bool:
    # A quantized weight keeps its own product: oneDNN cannot repack it. An inference tensor has no version counter to
    # tell when its packed copy is stale, a parameter of another class no `.data` that `WatchedParameter` could watch.
    return (
        dense_weight(weight)
        and type(weight) in (nn.Parameter, WatchedParameter)
        and weight.dtype in PACKABLE_DTYPES
        and not weight.is_inference()
    )


def _pack_draft_vocabulary(target: nn.Module, drafter: nn.Module) -> None:
    """Packs the rows of a drafter's draft vocabulary now, not in the first drafting cycle (tens of ms)."""
    vocab = getattr(drafter, "draft_vocab", None)
    heads = [getattr(target, "get_output_embeddings", lambda: None)()]
    embed_proj = getattr(drafter, "embed_proj", None)
    heads.append(embed_proj[-1] if isinstance(embed_proj, nn.Sequential) else None)
    if vocab is None:
        return
    with torch.no_grad():
        for head in heads:
            if isinstance(head, PrepackedLinear):
                head.rows_linear(head.weight.new_zeros(1, 1, head.in_features), vocab)


def _measure_verify_cost(target: nn.Module, drafter: nn.Module, batch_size: int, report: CpuFastPathReport) -> None:
    """The prepared target's verify-cost table, which the adaptive policy reads, measured now rather than in the first
    generate() with the drafter: 0.4 s of it on 2 cores for the 135M target, a tenth of a first 128-token answer.
    With `batch_size` > 1 also the `rows x (1 + k)` forwards of that batch (0.8 s at 8 rows), which a batch's first
    call would measure otherwise; smaller batches read between the two."""
    from transformers import DynamicCache

    from . import cost_model_domino
    from .cache_domino import check_croppable
    from .modeling_domino import hidden_state_indices
    from .options_domino import check_drafter_for_target
    from .recurrent_cache_domino import check_recurrent_target, keeps_recurrent_states

    try:  # measuring crops what it adds to a cache, or rolls its recurrent states back
        check_drafter_for_target(drafter, target)
        check_croppable(target, DynamicCache(config=target.config), batched=False)
        if keeps_recurrent_states(target):
            check_recurrent_target(target)
    except ValueError:  # not a pair that can draft: generate() names the problem and the fix, not preparing
        return
    layers = hidden_state_indices(drafter.config.target_layer_ids)  # what generate() asks of every forward
    forward_kwargs = {"output_hidden_states": layers}
    cost = cost_model_domino.verify_cost_for(
        target, lambda: cost_model_domino.measure_verify_cost_on_scratch(target, forward_kwargs)
    )
    if not cost.covers(batch_size):
        cost.update(cost_model_domino.measure_verify_cost_on_scratch(target, forward_kwargs, rows=batch_size))
    report.verify_ms = {tokens: 1000 * seconds for tokens, seconds in cost.seconds.items()}


def _check_compiles_in_generate(target: nn.Module) -> None:
    from .options_domino import static_caches_roll_back

    if getattr(target, "generation_config", None) is None:
        raise ValueError(
            f"compile=True sets how generate() runs the target, and this {type(target).__name__} has no "
            "generation_config: pass a model with generate() (a ...ForCausalLM), or drop compile=True."
        )
    # generate() itself declines to compile these, with a warning, and would run the static cache uncompiled.
    if any(tensor.device.type == "meta" for tensor in target.parameters()):
        raise ValueError(
            'compile=True: generate() does not compile a target with offloaded weights (a device_map with "cpu" '
            'or "disk" parts, accelerate\'s cpu_offload): drop compile=True, or load the whole target on the CPU.'
        )
    quantizer = getattr(target, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        raise ValueError(
            f"compile=True: generate() does not compile a target quantized by {type(quantizer).__name__}: drop "
            "compile=True."
        )
    if not static_caches_roll_back():
        raise ValueError(
            "compile=True compiles the target's forward on a static cache, which a drafter can roll back from "
            f"transformers 5.24 (this is {transformers.__version__}): upgrade transformers, or drop compile=True."
        )


def compiling_on_any_device(compile_config: CompileConfig | None = None) -> CompileConfig:
    """`compile_config` (a default one if None), told to compile generate()'s forward on any device, the CPU included.

    transformers compiles on a static cache only on GPUs unless its `CompileConfig` says otherwise, through a private
    flag (`_compile_all_devices`, transformers 5.23-5.25): set here, in one place."""
    compile_config = compile_config or CompileConfig()
    compile_config._compile_all_devices = True
    return compile_config


def _compile_in_generate(generation_config: GenerationConfig) -> bool:
    """Makes generate() compile the target's forward on a static cache, on the CPU too; False if it already did. A
    compile config the user set keeps its settings."""
    static = generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS
    if static and getattr(generation_config.compile_config, "_compile_all_devices", False):
        return False
    if not static:
        generation_config.cache_implementation = "static"
    generation_config.compile_config = compiling_on_any_device(generation_config.compile_config)
    return True


def prepare_for_cpu_decoding(
    target: nn.Module,
    drafter: nn.Module | None = None,
    *,
    match_drafter_dtype: bool = True,
    batch_size: int = 1,
    measure_products: bool = True,
    compile: bool = False,
) -> CpuFastPathReport:
    """Makes decoding on a CPU fast: oneDNN-prepacked linear layers in `target` and `drafter`, in place.

    One line before `generate()`; models on a GPU are left untouched, and calling it again changes nothing:

        report = hf_domino.prepare_for_cpu_decoding(target, drafter)
        print(report)  # target: 211 nn.Linear prepacked for oneDNN; drafter: 17 ...; 1076 MiB of packed weights

    Every `nn.Linear` (the LM head included) keeps its dense `weight`, so saving, loading and everything that reads
    the weights work as before, and multiplies by a packed copy instead (see the module docstring for when it falls
    back to `F.linear`), except at the few-row products where `F.linear` measures faster on this CPU
    (`measure_products`, default; a second or two: `measure_linear_dispatch`). With `match_drafter_dtype` (default),
    a drafter on the CPU whose dtype differs from the target's is cast to it first (fp16 products are slow on most
    CPUs). With a Domino drafter, the target's verify costs are measured here too (once per target, dtype and
    process), not in the first `generate()`; pass the largest `batch_size` you will give one `generate()` call, and a
    batch's first call does not measure them either.

    `compile=True` also makes the target's `generate()` run on a static cache with its forward compiled, on the CPU
    too (its `generation_config`: `cache_implementation="static"` and a `compile_config` told to compile on any
    device), so that plain `target.generate(**inputs, assistant_model=drafter)` runs the fastest CPU setup measured
    here (docs/usage.md, "A static cache"). The first calls compile, for minutes (repaid after about 5,000-23,000
    generated tokens on this project's CPU); a batch with the drafter takes the compiled target alone's steps, faster
    there than drafting on the batch loop's eager forward. Needs transformers>=5.24, where a static cache rolls back
    after a rejected draft. `save_pretrained` writes that cache implementation into the saved generation config: set
    `target.generation_config.cache_implementation = None` before saving.
    Returns what was changed (also logged).
    """
    for name, model in (("target", target), ("drafter", drafter)):
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                f"prepare_for_cpu_decoding takes the loaded models, got {type(model).__name__} for the {name}: load "
                "it first (e.g. DominoForSpeculation.from_pretrained(path) for a drafter)."
            )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"batch_size={batch_size!r}: pass the largest number of sequences you will give one generate() call with "
            "the drafter, a positive int (1 for one prompt at a time)."
        )
    if compile:
        _check_compiles_in_generate(target)
    report = CpuFastPathReport()
    if drafter is not None and match_drafter_dtype and _on_cpu(drafter) and _on_cpu(target):
        target_dtype = next(target.parameters()).dtype
        drafter_dtype = next(drafter.parameters()).dtype
        if drafter_dtype != target_dtype:
            drafter.to(target_dtype)
            report.casts.append(f"drafter cast from {drafter_dtype} to the target's {target_dtype}")
    _prepare(target, "target", report, measure_products)
    if drafter is not None:
        _prepare(drafter, "drafter", report, measure_products)
        _pack_draft_vocabulary(target, drafter)
        if "target" not in report.skipped and hasattr(getattr(drafter, "config", None), "target_layer_ids"):
            _measure_verify_cost(target, drafter, batch_size, report)
    if compile and _on_cpu(target):
        report.compiled = _compile_in_generate(target.generation_config)
    logger.info("CPU fast path: %s", report)
    return report


@contextlib.contextmanager
def as_by_default(model: nn.Module) -> Iterator[None]:
    """Inside this block, `model` runs as it would unprepared, to time it as it runs by default: linear layers
    multiply eagerly (`eager_linears`, every model's, in this thread), and its attention reads grouped key/value heads
    through `sdpa`'s copies again where preparing switched it (the model's setting: for every thread, so time it
    where nothing else runs it)."""
    switched = getattr(getattr(model, "config", None), "_attn_implementation", None) == GROUPED_KV_ATTENTION
    with eager_linears():
        if switched:
            model.set_attn_implementation("sdpa")
        try:
            yield
        finally:
            if switched:
                model.set_attn_implementation(GROUPED_KV_ATTENTION)


def is_prepared_for_cpu_decoding(model: nn.Module) -> bool:
    """Whether any linear layer of `model` runs prepacked (see `prepare_for_cpu_decoding`)."""
    return any(isinstance(module, PrepackedLinear) for module in model.modules())


__all__ = [
    "GROUPED_KV_ATTENTION",
    "CpuFastPathReport",
    "PrepackedLinear",
    "as_by_default",
    "compiling_on_any_device",
    "eager_linears",
    "is_prepared_for_cpu_decoding",
    "measure_linear_dispatch",
    "packable_dtypes",
    "prepare_for_cpu_decoding",
    "sdpa_grouped_kv_forward",
]
