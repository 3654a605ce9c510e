"""Measuring decoding methods: one generation per (method, prompt), interleaved per prompt in one process.

Methods (`parse_method`):

- `target`: the target's own `generate()` (greedy or sampling), the baseline every speedup is measured against;
- `target_eager`: the same as it runs unprepared (`cpu_fast_path.as_by_default`: every linear layer multiplying
  eagerly, `sdpa`'s own attention), always on the default dynamic cache: the target alone as it runs without the CPU
  fast path, and without the compiled forward of a static cache, when the run has them;
- `target_no_cudnn`: the target alone with the attention kernels a drafting call runs with
  (`attention_kernels_domino.drafting_attention_kernels`: cuDNN's left out on CUDA in float16/bfloat16; elsewhere the same
  as `target`; the bench adds it beside `target` where it differs), so that a drafter's speedup can be read apart
  from the kernel choice;
- `prompt_lookup`: transformers' n-gram prompt lookup (`prompt_lookup_num_tokens`), a drafter-free peer;
- `domino`: `generate(assistant_model=drafter)` with the default (adaptive) draft policy, whole vocabulary, drafts
  from the drafter only; `domino_vocab`: the same over the drafter's draft vocabulary; `domino_k<N>`
  (`domino_vocab_k<N>`): a fixed N drafts per forward; `_lookup` after `domino`/`domino_vocab` also copies drafts
  from the text (`domino_lookup=True`, what generate() does by default: `domino_vocab_lookup` is a user's default);
- `default`: `generate(assistant_model=drafter)` with no option at all, whatever the drafter's defaults are (the
  shipped drafter's: `domino_vocab_lookup`): what a user runs;
- `dflash`, `dflash_k<N>`: the same with the Domino head switched off (DFlash drafting, same weights);
- a Domino method with `@eager`, `@triton` or `@triton+graph` appended (`domino_vocab_k16@eager`) forces that
  `domino_rollout` (the default, `auto`, fuses the head on CUDA where it applies), to time the head's paths;
- `transformers_dflash`: transformers' own DFlash drafting (`speculation_type="dflash"`) with the drafter converted by
  `to_transformers_dflash` (a `shift_label=False` drafter; a Domino head is left out): a whole block every cycle over
  the whole vocabulary, the drafts `dflash_k<block - 1>` proposes, on transformers' code;
- `manual`: a minimal hand-written greedy draft/verify loop (`manual_generate`) over the same drafting ladder and
  the target's `DynamicCache`, to price what transformers' assisted-decoding loop costs around the same work.

Every generate() method can run on a static cache (`BenchSettings.cache_implementation`), where transformers compiles
the target's forward as it does the target alone's on a GPU (`compile_kwargs`). Acceptance is measured for every
method by `hf_domino.acceptance`, from the target's own forward calls.
`hf_domino.report` turns the records into tables and plots; `hf-domino bench` (bench.py) is the command.
"""

from __future__ import annotations

import contextlib
import copy
import re
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache

from .acceptance import acceptance_from_cache_lengths, record_target_forwards
from .assets import eos_token_ids, pad_token_id
from .attention_kernels_domino import drafting_attention_kernels
from .cache_domino import cache_argument
from .cost_model_domino import VerifyCost, cached_verify_cost, swap_verify_cost, synchronize
from .cpu_fast_path import as_by_default, compiling_on_any_device
from .drafting_domino import BlockDraft, DrafterContext, eager_rollout, run_backbone
from .modeling_domino import DominoForSpeculation, TargetModules, context_features, hidden_state_indices
from .options_domino import DominoOptions
from .recurrent_cache_domino import RecurrentRollback, record_past, rolls_back
from .transformers_dflash import to_transformers_dflash

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# `default` is what a user's `generate(assistant_model=drafter)` runs (generate()'s defaults: the draft vocabulary,
# copied and retrieved drafts); `domino` is the drafter alone over the whole vocabulary, as `manual` runs it.
METHODS = ("target", "prompt_lookup", "dflash", "domino", "default", "manual")
# Per-cycle pieces, in cycle order as plotted: draft (backbone, base logits, head rollout), then target verify.
TIMING_KEYS = ("backbone", "lm_head", "head", "verify")
_DRAFTER_METHOD = re.compile(
    r"^(domino|dflash)(_vocab)?(_lookup|_copies)?(?:_k(\d+))?(?:_tree(\d+))?(?:@(eager|triton|triton\+graph))?$"
)


@dataclass(frozen=True)
class MethodSpec:
    """What a method name means: which loop, and the Domino options of its generate() call."""

    name: str
    uses_drafter: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def adaptive(self) -> bool:
        """Whether its generate() call chooses its draft lengths with the adaptive policy (a drafter, no `_k<N>`)."""
        return (
            self.uses_drafter
            and self.name not in ("manual", "transformers_dflash")
            and self.options.get("draft_policy") != "fixed"
        )


def parse_method(name: str) -> MethodSpec:
    """`target`, `prompt_lookup`, `manual`, `default` (the drafter with generate()'s defaults), or `domino`/`dflash`,
    then optionally `_vocab`, `_lookup` (copies from the text and the drafter's datastore, as generate() by default) or
    `_copies` (from the text only), `_k<N>`, `_tree<N>` (N first-token branches, `domino_branches`; after `_k<N>` with
    the fixed policy), `@<rollout>`."""
    if name in ("target", "target_eager", "target_no_cudnn", "prompt_lookup"):
        return MethodSpec(name)
    if name in ("manual", "default", "transformers_dflash"):
        return MethodSpec(name, uses_drafter=True)
    match = _DRAFTER_METHOD.match(name)
    if match is None:
        raise ValueError(
            f"Unknown method {name!r}; choose among target, target_eager, target_no_cudnn, prompt_lookup, manual, default, transformers_dflash, domino, dflash, domino_vocab, "
            "domino_k<N>, domino_vocab_k<N>, domino_vocab_lookup, domino_vocab_copies (and the same for dflash), each optionally with @eager, @triton or "
            "@triton+graph (the Domino head's rollout)."
        )
    kind, vocab, lookup, fixed, branches, rollout = match.groups()
    if rollout is not None and kind != "domino":
        raise ValueError(f"Method {name!r}: @{rollout} picks the Domino head's rollout, and dflash has no head.")
    options: dict[str, Any] = {
        "domino_head": kind == "domino",
        "draft_vocab": vocab is not None,
        "domino_lookup": lookup is not None,
        "domino_datastore": lookup == "_lookup",
    }
    if fixed is not None:
        options |= {"draft_policy": "fixed", "num_speculative_tokens": int(fixed)}
    if branches is not None:
        options["domino_branches"] = int(branches)
    if rollout is not None:
        options["domino_rollout"] = rollout
    return MethodSpec(name, uses_drafter=True, options=options)


COMPILE_MODES = ("auto", "on", "off")


def compile_kwargs(cache_implementation: str | None, compile: str = "auto") -> dict[str, Any]:
    """generate() arguments for the cache and the compiled forward: `cache_implementation` (None: the dynamic cache);
    `compile` "auto" (transformers' rule: it compiles the forward with a static cache on a GPU), "on" (on any device,
    `compiling_on_any_device`) or "off" (`disable_compile`)."""
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile={compile!r}: choose among {', '.join(COMPILE_MODES)}.")
    kwargs: dict[str, Any] = {} if cache_implementation is None else {"cache_implementation": cache_implementation}
    if compile == "off":
        kwargs["disable_compile"] = True
    elif compile == "on":
        kwargs["compile_config"] = compiling_on_any_device()
    return kwargs


def generation_kwargs(
    target: PreTrainedModel, max_new_tokens: int, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> dict[str, Any]:
    """The sampling settings shared by every method: greedy, or sampling at `temperature` with top-k / top-p (0 and
    1.0: off, whatever the target's generation config says)."""
    kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": pad_token_id(target)}
    if temperature > 0:
        return kwargs | {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    return kwargs | {"do_sample": False}


# ------------------------------------------------------------------------------------------- measuring a generation
@dataclass
class Generation:
    """One method on one prompt: new tokens, wall time, tokens per target forward, drafts per forward, timings."""

    new_tokens: list[int]
    seconds: float
    acceptance_lengths: list[int]
    timings: dict[str, list[float]] | None = None
    drafted: list[int] | None = None
    copied: list[bool] | None = None  # per forward: drafts copied from the text or the datastore (`domino_lookup`)


class Stopwatch:
    """Adds the time since the previous tick to `timings[name]`; does nothing when `timings` is None."""

    def __init__(self, timings: dict[str, list[float]] | None, device: torch.device):
        self.timings, self.device = timings, device
        self.clock = time.perf_counter()

    def tick(self, name: str | None = None) -> None:
        if self.timings is None:
            return
        synchronize(self.device)
        now = time.perf_counter()
        if name is not None:
            self.timings.setdefault(name, []).append(now - self.clock)
        self.clock = now


# ------------------------------------------------------------------------------------------------------ manual loop
@torch.inference_mode()
def manual_generate(
    target: PreTrainedModel,
    drafter: DominoForSpeculation,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    timings: dict[str, list[float]] | None = None,
    num_drafts: int | None = None,
    head: bool = True,
    drafted: list[int] | None = None,
) -> torch.LongTensor:
    """Greedy speculative decoding without transformers' generation loop: draft a block, verify, keep the prefix.

    Drafts come from the same ladder as the candidate generator (`run_backbone`, `BlockDraft`, `eager_rollout`).
    Returns `input_ids` followed by the new tokens (at most `max_new_tokens`, cut after the first EOS), which are
    exactly the target's own greedy tokens. `num_drafts` caps the drafts per block (default: the whole block);
    `timings` (if given) receives per-cycle `backbone`, `lm_head`, `head` and `verify` seconds, and `drafted` (if
    given) the drafts each verification took, as `DominoGenerationStats.drafted` does.
    """
    config, modules = drafter.config, TargetModules.from_target(target)
    rollout = eager_rollout(drafter, modules, head=head)
    keep_layers = hidden_state_indices(config.target_layer_ids)  # only these hidden states are returned
    max_length = input_ids.shape[1] + max_new_tokens
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=input_ids.device)
    target_cache, context = DynamicCache(config=target.config), DrafterContext()
    stopwatch = Stopwatch(timings, drafter.device)
    block_drafts = config.num_drafts if num_drafts is None else min(num_drafts, config.num_drafts)

    outputs = target(input_ids, **cache_argument(target_cache), output_hidden_states=keep_layers, logits_to_keep=1)
    tokens = torch.cat([input_ids, outputs.logits[:, -1:].argmax(dim=-1)], dim=-1)
    context.append(context_features(outputs.hidden_states, config.target_layer_ids))  # every prompt token
    stopwatch.tick()
    while tokens.shape[1] < max_length and not bool(torch.isin(tokens[0, -1], eos)):
        budget = min(block_drafts, max_length - tokens.shape[1] - 1)
        draft_ids = tokens[:, :0]
        if budget > 0:
            hidden = run_backbone(drafter, modules, tokens, context, budget)
            stopwatch.tick("backbone")
            block = BlockDraft.from_hidden(hidden, modules)
            stopwatch.tick("lm_head")
            draft_ids = rollout(block, tokens).ids.to(tokens.device)
            stopwatch.tick("head")
        verify_ids = torch.cat([tokens[:, -1:], draft_ids], dim=-1)
        if drafted is not None:
            drafted.append(draft_ids.shape[1])
        outputs = target(verify_ids, **cache_argument(target_cache), output_hidden_states=keep_layers)
        predicted = outputs.logits.argmax(dim=-1)
        num_matches = int((draft_ids == predicted[:, :-1]).cumprod(dim=-1).sum())
        accepted = predicted[:, : num_matches + 1]  # matched drafts equal the target's tokens, plus the bonus token
        eos_positions = torch.isin(accepted[0], eos).nonzero()
        if eos_positions.numel():
            accepted = accepted[:, : int(eos_positions[0]) + 1]
        # Drop the rejected drafts: the cache keeps every verified token but the newest (the next anchor).
        target_cache.crop(num_matches - draft_ids.shape[1])
        context.append(context_features(outputs.hidden_states, config.target_layer_ids)[:, : num_matches + 1])
        tokens = torch.cat([tokens, accepted], dim=-1)[:, :max_length]
        stopwatch.tick("verify")
    return tokens


# ---------------------------------------------------------------------------------------------------- one method
def method_context(method: str, target: PreTrainedModel) -> contextlib.AbstractContextManager:
    """What a method runs inside besides its generation: eager linear layers for `target_eager`; a drafting call's
    attention kernels for `target_no_cudnn` and for the hand-written `manual` loop (generate() with a drafter picks
    them itself); nothing for the rest (the batch bench's methods too)."""
    if method == "target_eager":
        return as_by_default(target)
    if method in ("target_no_cudnn", "manual"):
        return drafting_attention_kernels(target.device, target.dtype)
    return contextlib.nullcontext()


# Each drafter's conversion for `transformers_dflash`, made once (a drafter's weights do not change during a bench).
_TRANSFORMERS_DFLASH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def transformers_dflash_model(drafter: DominoForSpeculation) -> torch.nn.Module:
    """`to_transformers_dflash(drafter)`, converted on first use."""
    if drafter not in _TRANSFORMERS_DFLASH:
        _TRANSFORMERS_DFLASH[drafter] = to_transformers_dflash(drafter)
    return _TRANSFORMERS_DFLASH[drafter]


def check_method(method: str, drafter: DominoForSpeculation | None, temperature: float = 0.0) -> None:
    """Raises, naming what is missing, where `method` cannot run with this drafter (or none) at `temperature`."""
    spec = parse_method(method)
    if spec.uses_drafter and drafter is None:
        raise ValueError(f"Method {method!r} needs a drafter.")
    if method == "manual" and temperature > 0:
        raise ValueError(f"Method {method!r} is greedy only; run it at --temperature 0.")
    if spec.options.get("domino_head") and not drafter.config.has_domino_head:
        raise ValueError(f"Method {method!r} needs a drafter with a Domino head (projector_type='domino').")
    if spec.options.get("draft_vocab") and drafter.draft_vocab is None:
        raise ValueError(f"Method {method!r} needs a drafter with a draft vocabulary (see `hf-domino draft-vocab`).")
    if spec.uses_drafter:  # its _k<N> and _tree<N> against the drafter's block
        try:
            DominoOptions.resolve(spec.options, None).validate_for(drafter.config)
        except ValueError as error:
            raise ValueError(f"Method {method!r}: {error}") from None


def run_method(
    method: str,
    target: PreTrainedModel,
    drafter: DominoForSpeculation | None,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    prompt_lookup_tokens: int = 10,
    record_timings: bool = True,
    num_speculative_tokens: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    cache_implementation: str | None = None,
    compile: str = "auto",
) -> Generation:
    """Generates once with `method` and measures it (wall time around the whole call, prefill included).

    `num_speculative_tokens` caps the drafts per forward of every drafter method without a fixed `_k<N>`; `top_k` and
    `top_p` apply when sampling (`temperature > 0`); `cache_implementation` and `compile` as `compile_kwargs`.
    """
    spec = parse_method(method)
    if method == "manual" and cache_implementation is not None:
        raise ValueError(f"Method {method!r} runs its own loop on a dynamic cache; drop it with a static cache.")
    check_method(method, drafter, temperature)
    input_ids = input_ids.to(target.device)
    ours = spec.uses_drafter and method != "transformers_dflash"  # drafting through hf-domino
    # Converted before the clock starts (and once per drafter): the conversion copies the drafter's weights.
    native = transformers_dflash_model(drafter) if method == "transformers_dflash" else None
    timings = {} if record_timings and ours else None
    drafted = copied = None
    with record_target_forwards(target) as cache_lengths, method_context(method, target):
        start = time.perf_counter()
        if method == "manual":
            head, drafted = drafter.config.has_domino_head, []
            output = manual_generate(
                target,
                drafter,
                input_ids,
                max_new_tokens,
                eos_token_ids(target),
                timings,
                num_speculative_tokens,
                head,
                drafted,
            )
            copied = [False] * len(drafted)
        else:
            kwargs = generation_kwargs(target, max_new_tokens, temperature, top_k, top_p)
            if method != "target_eager":  # the target as it runs by default: no compiled forward to compare with
                kwargs |= compile_kwargs(cache_implementation, compile)
            if method == "prompt_lookup":
                kwargs["prompt_lookup_num_tokens"] = prompt_lookup_tokens
            elif method == "transformers_dflash":
                kwargs |= {"assistant_model": native, "speculation_type": "dflash"}
            elif spec.uses_drafter:
                kwargs |= {"assistant_model": drafter, "domino_timings": record_timings, **spec.options}
                if num_speculative_tokens is not None and "num_speculative_tokens" not in spec.options:
                    kwargs["num_speculative_tokens"] = num_speculative_tokens
            output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        synchronize(target.device)
        seconds = time.perf_counter() - start
    if ours and method != "manual":
        stats = drafter.last_generation_stats
        drafted = list(stats.drafted)
        copied = [text or store for text, store in zip(stats.copied, stats.retrieved)]  # no drafter ran
        if record_timings:
            timings = {key: list(values) for key, values in (stats.timings or {}).items()}
    return Generation(
        new_tokens=output[0, input_ids.shape[1] :].tolist(),
        seconds=seconds,
        acceptance_lengths=acceptance_from_cache_lengths(cache_lengths, output.shape[1]),
        timings=timings,
        drafted=drafted,
        copied=copied,
    )


@torch.inference_mode()
def measure_forward_ms(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    lengths: Sequence[int],
    drafter: DominoForSpeculation | None = None,
    repeats: int = 5,
) -> dict[int, float]:
    """Median ms of one target forward over `length` new tokens after `input_ids` is cached, for each length.

    This is the verify cost of a block of `length - 1` drafts (1 = plain decoding), with the drafter's hidden-state
    selection when a drafter is given; it decides how many tokens per forward a drafter must reach to pay off.
    """
    input_ids = input_ids.to(target.device)
    hidden_states = hidden_state_indices(drafter.config.target_layer_ids) if drafter is not None else False
    cache = DynamicCache(config=target.config)
    target(input_ids, **cache_argument(cache), logits_to_keep=1)
    # Recurrent layers: each forward as a drafting call's verification runs it, keeping one token (`rollback`).
    rollback = None
    if rolls_back(cache, target):
        record_past(cache)
        rollback = RecurrentRollback.install(cache, input_ids.shape[1], target)
    costs = {}
    try:
        for length in lengths:
            block = input_ids[:, -1:].expand(1, length)  # token values do not change the cost
            samples = []
            for _ in range(repeats):
                if rollback is not None:
                    rollback.feed(rollback.committed + length)
                start = time.perf_counter()
                target(block, **cache_argument(cache), output_hidden_states=hidden_states)
                synchronize(target.device)
                samples.append(1000 * (time.perf_counter() - start))
                if rollback is None:
                    cache.crop(-length)
                else:
                    rollback.crop(1 - length)
            costs[length] = statistics.median(samples)
    finally:
        if rollback is not None:
            rollback.remove()
    return costs


# ----------------------------------------------------------------------------------------------------- benchmark
@dataclass
class BenchSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # with temperature > 0; 0: off
    top_p: float = 1.0  # with temperature > 0; 1.0: off
    seed: int = 0
    prompt_lookup_tokens: int = 10
    warmup_tokens: int = 16
    num_speculative_tokens: int | None = None
    cache_implementation: str | None = None  # "static": every generate() method on a static cache
    compile: str = "auto"  # see compile_kwargs


@dataclass
class BenchResult:
    methods: list[str]
    settings: BenchSettings
    # records[method][prompt index]
    records: dict[str, list[Generation]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    title: str = ""  # plot subtitle, e.g. "(mtbench, T=0)"
    # Median ms of one target forward by the number of tokens it takes, with the first prompt cached.
    forward_ms: dict[int, float] = field(default_factory=dict)
    # The same with eager linear layers, when `target_eager` ran (the CPU fast path's baseline).
    eager_forward_ms: dict[int, float] = field(default_factory=dict)
    # Each drafting method's verify cost model for the target after the run (ms by tokens per forward).
    policy_verify_ms: dict[str, dict[int, float]] = field(default_factory=dict)


@contextlib.contextmanager
def own_verify_cost(target: PreTrainedModel, tables: dict[str, VerifyCost], method: str):
    """Runs the block with `tables[method]` as `target`'s verify-cost table (first a copy of the process's, which is
    put back after), so that each method compared in one process refines its own from its own loop's timings, as it
    would in a process of its own: one table refined by transformers' loop and by the batch loop in turn prices
    neither's forwards."""
    shared = cached_verify_cost(target)
    if method not in tables and shared is not None:
        tables[method] = copy.deepcopy(shared)
    swap_verify_cost(target, tables.get(method))
    try:
        yield
    finally:
        table = swap_verify_cost(target, shared)
        if table is not None:
            tables[method] = table


def warmup_lengths(warmup_tokens: int, static_cache: bool) -> list[int]:
    """How many new tokens each warm-up generation makes: `warmup_tokens`, and on a static cache a second generation
    one token longer (the bench's and the demo's warm-ups).

    A compiled forward is compiled for its static cache's length, then once more, for any length, at the next length
    (dynamo's automatic dynamic shapes). generate() keeps a static cache that is long enough for the next call, so
    only a longer one is new: the second warm-up pays that recompilation, not the first timed generation.
    """
    return [warmup_tokens, warmup_tokens + 1] if static_cache else [warmup_tokens]


def warm_verification_lengths(
    target: PreTrainedModel,
    drafter: DominoForSpeculation | None,
    input_ids: torch.LongTensor,
    warmup_tokens: int,
    compile_settings: dict[str, Any],
) -> None:
    """On a static cache with the target's forward compiled (`compile_settings`: the generate() arguments that ask
    for them, e.g. `compile_kwargs`' answer, or `{"cache_implementation": "static"}` on a GPU), compiles
    the forwards a drafter's verification needs for any number of drafts and any cache length, so that no timed
    generation compiles (with inductor: minutes on a CPU, tens of seconds on a GPU).

    Dynamo compiles a forward for the shapes it first meets, then once more, dynamic in each size it has seen change
    (one token is always a shape of its own). The policies' own warm-ups verify what their timings choose, sometimes
    one number of drafts only, at two cache lengths, so the timed generation could still meet a new pair: found as a
    test that compiled in its timed call, on a loaded machine. Three short greedy generations (the fixed policy,
    which learns nothing, and no copies, whose acceptance would be recorded) leave no pair new: 1 draft per forward,
    then 2 with a cache one token longer (query and cache length both dynamic), then plain steps on that cache.
    """
    if drafter is None:
        return
    settings = generation_kwargs(target, warmup_tokens, temperature=0.0) | compile_settings
    settings |= {"assistant_model": drafter, "draft_policy": "fixed", "domino_lookup": False}
    input_ids = input_ids.to(target.device)  # the bench keeps its prompts on the CPU
    attention_mask = torch.ones_like(input_ids)
    two = min(2, drafter.config.num_drafts)
    for tokens, drafts in ((warmup_tokens, 1), (warmup_tokens + 1, two), (warmup_tokens + 1, 0)):
        call = settings | {"max_new_tokens": tokens, "num_speculative_tokens": drafts}
        target.generate(input_ids, attention_mask=attention_mask, **call)


def run_benchmark(
    target: PreTrainedModel,
    drafter: DominoForSpeculation | None,
    prompts: Sequence[torch.LongTensor],
    methods: Sequence[str],
    settings: BenchSettings | None = None,
    progress: bool = True,
    on_prompt: Callable[[BenchResult], None] | None = None,
) -> BenchResult:
    """Runs every method on every prompt, interleaved per prompt, after one short warm-up generation per method.
    `on_prompt` sees the result so far after each prompt (the bench saves it, for a run that gets stopped).

    The method order rotates from prompt to prompt so that no method always runs right after the same other one
    (caches, CPU frequency). With sampling, each (prompt, method) pair is seeded with the same seed. Each drafting
    method learns on its own, as in a process of its own: its own copy of the drafter (the policies' records are
    kept per drafter) and of the target's verify-cost table (`own_verify_cost`).
    """
    from tqdm.auto import tqdm

    settings = settings or BenchSettings()
    methods = list(methods)
    for method in methods:
        parse_method(method)  # unknown names fail before any generation
    result = BenchResult(methods=methods, settings=settings, records={method: [] for method in methods})
    if not prompts:
        return result

    drafters = {
        method: copy.deepcopy(drafter) if drafter is not None and parse_method(method).uses_drafter else drafter
        for method in methods
    }
    tables: dict[str, VerifyCost] = {}

    def generate(method: str, input_ids: torch.LongTensor, max_new_tokens: int, seed: int) -> Generation:
        torch.manual_seed(seed)
        with own_verify_cost(target, tables, method):
            return run_method(
                method,
                target,
                drafters[method],
                input_ids,
                max_new_tokens,
                temperature=settings.temperature,
                prompt_lookup_tokens=settings.prompt_lookup_tokens,
                num_speculative_tokens=settings.num_speculative_tokens,
                top_k=settings.top_k,
                top_p=settings.top_p,
                cache_implementation=settings.cache_implementation,
                compile=settings.compile,
            )

    for copied in {id(d): d for d in drafters.values() if d is not None and d.datastore is not None}.values():
        copied.datastore.build_index()  # else whichever generation retrieves first pays for it
    if settings.cache_implementation is not None:  # before the policies' warm-ups, which then time no compiling
        compile_settings = compile_kwargs(settings.cache_implementation, settings.compile)
        warm_verification_lengths(target, drafter, prompts[0], settings.warmup_tokens, compile_settings)
    for method in methods:  # warm-up: allocator, kernels, lazy imports, the draft policy's cost calibration
        for warmup_tokens in warmup_lengths(settings.warmup_tokens, settings.cache_implementation is not None):
            generate(method, prompts[0], warmup_tokens, settings.seed)
    drafts = [drafter.config.num_drafts] if drafter is not None else []
    block_lengths = sorted({1, 2, 3, 4, 5, 8, *(n + 1 for n in drafts)})
    result.forward_ms = measure_forward_ms(target, prompts[0], block_lengths, drafter)
    if "target_eager" in methods:
        with as_by_default(target):
            result.eager_forward_ms = measure_forward_ms(target, prompts[0], block_lengths, drafter)
    with tqdm(total=len(prompts) * len(methods), desc="bench", unit="gen", disable=not progress) as bar:
        for index, input_ids in enumerate(prompts):
            shift = index % len(methods)
            results = {}
            for method in methods[shift:] + methods[:shift]:
                bar.set_postfix_str(method)
                results[method] = generate(method, input_ids, settings.max_new_tokens, settings.seed + index)
                bar.update()
            for method in methods:
                result.records[method].append(results[method])
            if on_prompt is not None:
                on_prompt(result)
    result.policy_verify_ms = {
        method: {n: 1000 * seconds for n, seconds in tables[method].seconds.items()}
        for method in methods
        if method in tables and parse_method(method).adaptive
    }
    return result
