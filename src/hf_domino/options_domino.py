"""What one `generate(..., assistant_model=drafter)` call may ask for, and what it reports.

`DominoOptions` holds the call's Domino options (generate() keyword arguments, or attributes of a `GenerationConfig`),
validated once before any generation work; `check_drafter_for_target` refuses a drafter/target pair or a generation
setting that drafting cannot serve, naming the fix; `DominoGenerationStats` is what the call did, read from
`drafter.last_generation_stats` afterwards. Both decoding loops (`generation_domino` for one sequence,
`batching_domino` for a batch) read them.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import StaticLayer
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS, SynthIDTextWatermarkingConfig
from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL

from .configuration_domino import (
    OWN_ARCHITECTURE,
    SERVING_ARCHITECTURE,
    SERVING_MODEL_TYPE,
    DominoConfig,
    target_depth,
)
from .modeling_domino import DOMINO_HEAD_DEFAULT
from .target_modules_domino import target_execution_device

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

    from .modeling_domino import DominoForSpeculation


@dataclass
class DominoGenerationStats:
    """What one `generate()` call did with a drafter; read it from `drafter.last_generation_stats` afterwards.

    `acceptance_lengths[i]` is the number of tokens the i-th target forward after the prefill added (accepted drafts
    plus the target's own token); `drafted[i]` how many drafts it verified (0: a plain target step), and
    `copied[i]` whether they were copied from the text (`domino_lookup`) and `retrieved[i]` whether from the drafter's
    datastore (`domino_datastore`) rather than drafted by the drafter. `timings`
    (seconds per drafting cycle, with `domino_timings=True`) splits each cycle into `backbone`, `lm_head` (base
    logits of the drafted positions), `head` (the sequential rollout: Domino head and token picking) and `verify`
    (target forward and acceptance, timed from the end of drafting to the loop's next call). With
    `domino_branches`, `branches[i]` is the branch the i-th forward went on along (0: the likeliest first draft; also
    0 where the target took none of them, and where the forward verified one block or none), and `drafted[i]` counts
    the drafts of that branch. `rereads` counts the forwards that read a rolled-back verification's tokens again
    (a target with recurrent states whose verification kept no scan inputs, as in a compiled forward).
    """

    acceptance_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    copied: list[bool] = field(default_factory=list)
    retrieved: list[bool] = field(default_factory=list)
    timings: dict[str, list[float]] | None = None
    branches: list[int] = field(default_factory=list)
    rereads: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


# ------------------------------------------------------------------------------------------------------- options
DRAFT_POLICIES = ("adaptive", "fixed")
MAX_BRANCHES = 8
ROLLOUTS = ("auto", "eager", "triton", "triton+graph")


@dataclass(frozen=True)
class DominoOptions:
    """The options of one `generate(..., assistant_model=drafter)` call, passed as generate() keyword arguments.

    Our own names can also be set as attributes of a `GenerationConfig` (e.g. `GenerationConfig(draft_policy=
    "fixed", num_speculative_tokens=4)` or `target.generation_config.draft_policy = "fixed"`); a keyword argument
    wins. `assistant_confidence_threshold` keeps transformers' meaning (drafting stops at the first draft whose
    probability is below it) and applies only when passed to generate() explicitly, since every generation config
    carries transformers' default of 0.4 for ordinary assistants.

    Attributes:
        draft_policy: `"adaptive"` (default: drafts verified per block chosen from a measured cost model and the
            drafts' confidence; 0 = a plain target step) or `"fixed"` (always `num_speculative_tokens`).
        num_speculative_tokens: drafts per target forward: the cap for `"adaptive"`, the exact number for
            `"fixed"` (0 = never draft). Default: the drafter's whole block.
        assistant_confidence_threshold: see above; in (0, 1).
        domino_head: the Domino head on (`True`) or off (`False`: DFlash drafting, same weights); `None`, the
            default, means on when the drafter has a head, or what an enclosing `with drafter.domino_head(...)` set.
        draft_vocab: compute drafts over the drafter's draft vocabulary, when it has one (default True).
        domino_rollout: `"auto"` (the fused Triton/CUDA-graph head on CUDA when it applies), `"eager"`, `"triton"`,
            `"triton+graph"` (forced: raise when they cannot run). See docs/fast_path.md.
        domino_lookup: also draft by copying from the text (prompt lookup, default True): where the sequence's last
            3 or 2 tokens occurred before, the tokens that followed them are verified instead of a drafted block,
            as many as pay by their acceptance so far. Off with `assistant_ensemble_weight`.
        domino_datastore: with `domino_lookup`, also draft by retrieval from the drafter's datastore when it has one
            (default True): where the text offers no copy, the continuation that the target's own earlier answers share after the sequence's last 4, 3 or
            2 tokens (`copied_drafts_domino.DraftDatastore`), priced like copies with an acceptance of its own.
        domino_timings: record per-cycle timings in `drafter.last_generation_stats.timings` (drafted cycles only).
        domino_cudnn_attention: let scaled_dot_product_attention pick cuDNN's kernels during the call (default
            False: on CUDA in float16/bfloat16 the call runs with every other enabled SDPA kernel; on a CPU, or in
            float32, nothing changes). cuDNN builds an execution plan for each new pair of query and key lengths,
            and a drafting cycle meets a new pair at every forward (`attention_kernels_domino.drafting_attention_kernels`).
        domino_branches: verify each drafted block as a tree of this many branches (default 1: one block), one per
            first draft among the drafter's likeliest, each continued by the Domino head from its own first draft, in
            one target forward of 1 + branches x k tokens; the branch whose first draft the target picks goes on.
            The adaptive policy chooses k (at most the drafts per block / branches) and how many of the branches to
            verify per cycle; the fixed one verifies every branch with k = `num_speculative_tokens`. Greedy or
            sampling. Runs in the batch loop, also for one sequence (docs/usage.md, "First-token
            branches").
    """

    draft_policy: str = "adaptive"
    num_speculative_tokens: int | None = None
    assistant_confidence_threshold: float | None = None
    domino_head: bool | None = None
    draft_vocab: bool = True
    domino_rollout: str = "auto"
    domino_lookup: bool = True
    domino_datastore: bool = True
    domino_timings: bool = False
    domino_cudnn_attention: bool = False
    domino_branches: int = 1

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def resolve(cls, call_options: dict[str, Any], generation_config: GenerationConfig | None) -> DominoOptions:
        """Keyword arguments of the call, else our own attributes of the generation config, else the defaults."""
        values = {}
        for name in cls.names():
            if name in call_options:
                values[name] = call_options[name]
            elif name != "assistant_confidence_threshold" and getattr(generation_config, name, None) is not None:
                values[name] = getattr(generation_config, name)
        if values.get("domino_head") is None and DOMINO_HEAD_DEFAULT.get() is not None:
            values["domino_head"] = DOMINO_HEAD_DEFAULT.get()
        return cls(**values)

    def validate(self, drafter: DominoForSpeculation) -> None:
        """Raises a `ValueError` naming the option, the bad value and what is allowed (for the drafter's device too)."""
        self.validate_for(drafter.config)
        self.validate_device(drafter.device)

    def validate_for(self, config: DominoConfig) -> None:
        """`validate` against a drafter's config, before (or without) loading its weights."""
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"draft_policy must be one of {DRAFT_POLICIES}, got {self.draft_policy!r}.")
        cap = self.num_speculative_tokens
        block = config.num_drafts
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= block):
            raise ValueError(
                f"num_speculative_tokens must be an int from 0 to the drafter's {block} drafts per block (or None for "
                f"all of them), got {cap!r}."
            )
        threshold = self.assistant_confidence_threshold
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 < threshold < 1
        ):
            raise ValueError(
                f"assistant_confidence_threshold must be a number in (0, 1), a probability, got {threshold!r}; pass "
                "e.g. assistant_confidence_threshold=0.4, or drop it to let the draft policy alone decide."
            )
        if self.domino_head is not None and not isinstance(self.domino_head, bool):
            raise ValueError(
                f"domino_head must be True, False or None (the default: the head when the drafter has one), got "
                f"{self.domino_head!r}."
            )
        for name in ("draft_vocab", "domino_lookup", "domino_datastore", "domino_timings", "domino_cudnn_attention"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}.")
        if self.domino_head and not config.has_domino_head:
            raise ValueError("domino_head=True needs a drafter with a Domino head; this one drafts as DFlash.")
        if self.domino_rollout not in ROLLOUTS:
            raise ValueError(f"domino_rollout must be one of {ROLLOUTS}, got {self.domino_rollout!r}.")
        branches = self.domino_branches
        if isinstance(branches, bool) or not isinstance(branches, int) or not 1 <= branches <= MAX_BRANCHES:
            raise ValueError(f"domino_branches must be an int from 1 to {MAX_BRANCHES}, got {branches!r}.")

    def validate_device(self, device: torch.device | str) -> None:
        """Refuses a forced Triton rollout (`domino_rollout`) the drafter's device cannot run, before any call: CUDA
        graphs need CUDA, and the kernels run elsewhere only under Triton's interpreter (`TRITON_INTERPRET=1`, for
        tests). `fused_head.select_rollout` checks again at the call, against the kernels as built."""
        if self.domino_rollout not in ("triton", "triton+graph"):
            return
        try:
            device = torch.device(int(device) if str(device).isdigit() else device)
        except (RuntimeError, TypeError, ValueError):  # a device map ("balanced", ...): its devices are not known yet
            return
        if device.type == "cuda":
            return
        interpreted = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
        if self.domino_rollout == "triton+graph" or not interpreted:
            needs = "CUDA (CUDA graphs)" if self.domino_rollout == "triton+graph" else "CUDA, or Triton's interpreter"
            raise ValueError(
                f"domino_rollout={self.domino_rollout!r} needs {needs}, and the drafter is on {device}: use "
                "domino_rollout='auto' (fused where it can run) or 'eager'."
            )

    @property
    def reads_cycle_times(self) -> bool:
        """Whether the loops use their clock readings: timings asked for, or the adaptive policy learning from them
        (on CUDA each reading then waits for the device, `cost_model_domino.settle_for_timing`)."""
        return self.domino_timings or self.draft_policy != "fixed"

    def head_enabled(self, drafter: DominoForSpeculation) -> bool:
        return drafter.config.has_domino_head and self.domino_head is not False

    def drafts_per_block(self, drafter: DominoForSpeculation) -> int:
        """The cap on drafts verified per target forward."""
        cap = self.num_speculative_tokens
        return drafter.config.num_drafts if cap is None else cap

    def cache_columns(self, drafter: DominoForSpeculation, max_length: int) -> int:
        """Columns a call's target cache can reach: its `max_length`, plus a last verification's drafts past it (the
        room `cache_domino.buffer_layers` reserves, never taken early)."""
        return max_length + self.drafts_per_block(drafter) + 1


# ------------------------------------------------------------------------------------------------ compatibility checks
def static_caches_roll_back() -> bool:
    """Whether this transformers release rolls a static cache back after a rejected draft: 5.24 gave `StaticLayer` a
    `crop`, and its assisted loop then keeps the static cache (and compiles the target's forward where it compiles
    the target alone's); 5.23's static layers cannot be cropped."""
    return bool(getattr(StaticLayer, "is_croppable", False))


def check_drafter_config_for_target_config(config: DominoConfig, target_model_config: PretrainedConfig) -> None:
    """The part of `check_drafter_for_target` that the two configs decide (a server checks it before loading)."""
    target_config = target_model_config.get_text_config()
    if getattr(target_model_config, "is_encoder_decoder", False):
        raise ValueError("Domino drafters work with decoder-only targets; this target is an encoder-decoder model.")
    num_layers = target_depth(target_config)
    if num_layers is None:
        raise ValueError(
            f"{type(target_model_config).__name__} does not report num_hidden_layers, so its model cannot provide the "
            "per-layer hidden states (output_hidden_states) a Domino drafter reads."
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
    if config.num_target_layers is not None and config.num_target_layers != num_layers:
        warnings.warn(
            f"This drafter was built for a target of {config.num_target_layers} layers and this one has {num_layers}"
            ": it reads another model's hidden states, so its drafts will seldom be accepted (the output stays the "
            "target's). Use a drafter trained for this target.",
            stacklevel=3,
        )


def checked_datastore(drafter: DominoForSpeculation) -> Any:
    """`drafter.datastore`, for a call that retrieves from it: raises where it is not a `DraftDatastore` of ids in the
    drafter's (the target's) vocabulary, whose drafts would fail deep inside the target's forward."""
    datastore = getattr(drafter, "datastore", None)
    if datastore is None:
        return None
    # By what it does, not its class: a drafter loaded with trust_remote_code holds the checkpoint's own copy of it.
    if not callable(getattr(datastore, "lookup", None)):
        raise TypeError(
            f"drafter.datastore must be a DraftDatastore or None, got {type(datastore).__name__}: build one with "
            "hf_domino.copied_drafts_domino.DraftDatastore.from_sequences(token_id_lists)."
        )
    if getattr(datastore, "max_id", -1) >= drafter.config.vocab_size:
        raise ValueError(
            f"drafter.datastore holds token id {datastore.max_id}, outside the target's vocabulary of "
            f"{drafter.config.vocab_size}: build it from text tokenized with the target's tokenizer, or set "
            "drafter.datastore = None."
        )
    return datastore


def check_synced_gpus(synced_gpus: bool) -> None:
    """Refuses `synced_gpus` (generate()'s default under DeepSpeed ZeRO-3 or FSDP across processes): it keeps every
    process stepping the sharded target until all are done, which transformers' assisted loop does only in part (a
    process that finished first goes on appending tokens past its EOS) and the batch loop not at all (processes fall
    out of step: a hang)."""
    if synced_gpus:
        raise ValueError(
            "synced_gpus=True (generate()'s default for a target sharded with DeepSpeed ZeRO-3 or FSDP across processes) "
            "is not served with a drafter: the processes would verify different numbers of tokens per forward and fall "
            "out of step. Generate with the drafter on a target each process holds whole (gather its parameters first: "
            "deepspeed.zero.GatheredParameters, FSDP.summon_full_params), or without assistant_model."
        )


# generate()'s settings for transformers' own assistants (an assistant model's draft length and its schedule, a
# tokenizer-translating assistant's look-behind, an early-exit assistant): a Domino drafter reads none of them.
OTHER_ASSISTANT_SETTINGS = (
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_lookbehind", "target_lookbehind",
    "assistant_early_exit",
)  # fmt: skip


def warn_of_other_assistant_settings(call_kwargs: dict[str, Any]) -> None:
    """Warns where a drafted call passes settings only transformers' own assistants read: they change nothing here."""
    passed = [name for name in OTHER_ASSISTANT_SETTINGS if call_kwargs.get(name) is not None]
    if passed:
        warnings.warn(
            f"{', '.join(passed)}: settings of transformers' own assistants, which a Domino drafter does not read. The "
            "number of drafts a target forward verifies is num_speculative_tokens (a cap under the adaptive policy, "
            "the number under draft_policy='fixed'; docs/usage.md, \"Options\").",
            stacklevel=2,
        )


def check_drafter_for_target(drafter: DominoForSpeculation, target: PreTrainedModel, generation_config=None) -> None:
    """Raises a `ValueError` that names the problem and the fix when `drafter` cannot draft for `target`."""
    check_drafter_config_for_target_config(drafter.config, target.config)
    supports_dynamic_cache = getattr(type(target), "_supports_default_dynamic_cache", lambda: True)
    if not supports_dynamic_cache():
        # transformers' assisted loop then fails with "Assisted decoding requires a cache".
        raise ValueError(
            f"{type(target).__name__} keeps its states in a cache of its own (MiniMax's lightning attention, RWKV, "
            "xLSTM), which transformers does not hand to a drafting loop and which cannot drop a verification's "
            "rejected drafts: generate without the drafter."
        )
    target_device = target_execution_device(target)
    if drafter.device.type != target_device.type:
        # A pipeline moves its model to the GPU by default and leaves an assistant object where it is. Each block
        # would carry the target's hidden states across to the drafter, and its drafts through the target's LM head.
        raise ValueError(
            f"The drafter is on {drafter.device} and the target on {target_device}: a drafter runs beside its target "
            f'on every block. Move it with drafter.to("{target_device}", target.dtype); with pipeline(), also pass '
            "device=target.device, or the pipeline moves the target to the GPU without the drafter."
        )
    if drafter.device.type == "cpu" and drafter.dtype == torch.float16 and target.dtype != torch.float16:
        # The shipped checkpoint is fp16, so a plain from_pretrained gives this: fp16 products on most CPUs run
        # several times slower than fp32 ones, and every draft casts the target's features.
        warnings.warn(
            f"The drafter is float16 on the CPU next to a {target.dtype} target: drafting will be slow. Call "
            "drafter.to(target.dtype), or hf_domino.prepare_for_cpu_decoding(target, drafter) (which also does it).",
            stacklevel=2,
        )
    if generation_config is None:
        return
    if generation_config.num_beams is not None and generation_config.num_beams > 1:
        raise ValueError(
            f"num_beams={generation_config.num_beams}: beam search cannot be verified with a drafter (transformers "
            "would silently ignore it). Use num_beams=1 with the drafter, or drop assistant_model for beam search."
        )
    if generation_config.use_cache is False:
        raise ValueError(
            "use_cache=False (passed to generate(), or set by the target's generation config or config, as MPT's "
            "is): a drafter's blocks are verified against the target's key/value cache and rolled back in it on "
            "rejection. Pass use_cache=True (the output is the same), or drop assistant_model."
        )
    if generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS and not static_caches_roll_back():
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} with a drafter needs transformers>=5.24: "
            "earlier releases cannot roll a static cache back after a rejected draft. Upgrade transformers, or drop "
            "cache_implementation (the default dynamic cache gives the same output)."
        )
    chunk_size = generation_config.prefill_chunk_size
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(
            f"prefill_chunk_size={chunk_size!r}: the prompt is read in chunks of that many tokens, so it must be a "
            "positive int. Pass e.g. prefill_chunk_size=2048, or None to read the prompt in one forward."
        )
    attention = target.config._attn_implementation
    if generation_config.return_dict_in_generate and generation_config.output_attentions and attention != "eager":
        # Such kernels return no weights, and transformers' assisted loop then fails with an IndexError (its prompt
        # lookup too), where the target alone returns empty attentions.
        raise ValueError(
            f"output_attentions=True with the target's {attention!r} attention, which returns no attention weights: "
            "load the target with attn_implementation='eager' (or call target.set_attn_implementation('eager')) to get "
            "them, or drop output_attentions."
        )
    _refuse_per_token_state(generation_config)
    if getattr(generation_config, "speculation_type", None) is not None:
        raise ValueError(
            f"speculation_type={generation_config.speculation_type!r} selects another transformers drafting path; "
            "a Domino drafter drafts by itself. Remove it (for DFlash-style drafting use drafter.domino_head(False)); "
            "to draft on transformers' own DFlash path instead, pass hf_domino.to_transformers_dflash(drafter) as the "
            "assistant_model (shift_label=False drafters only)."
        )


def prefill_chunk_size(generation_config: GenerationConfig, model_kwargs: dict[str, Any]) -> int | None:
    """The chunks a drafted call's prefill reads the prompt in (`prefill_chunk_size`, as the target alone's
    `_prefill`), or None: none asked for, or a prompt the prefill reads whole, and says so (given as `inputs_embeds`,
    or with images, audio or video, which transformers' chunks cannot split either)."""
    chunk_size = generation_config.prefill_chunk_size
    if chunk_size is None:
        return None
    whole = [
        name for name in ("inputs_embeds", *MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL)
        if model_kwargs.get(name) is not None and not (isinstance(model_kwargs[name], dict) and not model_kwargs[name])
    ]  # fmt: skip
    if whole:
        warnings.warn(
            f"prefill_chunk_size={chunk_size} is not applied with a drafter to a prompt given with {whole}: the "
            "prompt is read in one forward, whose memory peak is the unchunked prefill's. Pass the prompt as "
            "input_ids alone to have it read in chunks.",
            stacklevel=3,
        )
        return None
    return chunk_size


def refuse_a_drafter_built_as_another_model(assistant: Any) -> None:
    """Raises a `ValueError` when `assistant` was built from a Domino or DFlash drafter's folder as another class.

    Drafter folders say `model_type: qwen3`, as serving stacks expect (docs/model.md, "Who reads what"), so
    `AutoModelForCausalLM.from_pretrained(folder)`, the usual way to load an assistant, or `AutoModel.from_pretrained`
    without `trust_remote_code=True`, builds a plain Qwen3 model from them: the backbone's layers load, but the
    drafter's own parts (`fc`, `hidden_norm`, the Domino head) are left out and the embeddings and LM head it would
    borrow from its target are fresh. transformers would then draft with it at random, many times slower than the
    target alone and without a word (or fail deep inside its assisted loop).
    """
    config = getattr(assistant, "config", None)
    names = list(getattr(config, "architectures", None) or [])
    # Only the model_type fallback's Qwen3 classes: another class reading these folders (a DFlash model of
    # transformers' own, say) is its library's to judge.
    built_as_qwen3 = getattr(config, "model_type", None) == SERVING_MODEL_TYPE
    if not built_as_qwen3 or not {SERVING_ARCHITECTURE, OWN_ARCHITECTURE} & set(names):
        return
    if type(assistant).__name__ in names:  # the reference implementation's own class, loaded by its remote code
        return
    raise ValueError(
        f"assistant_model is a {type(assistant).__name__} built from a Domino/DFlash drafter's checkpoint (its config "
        f"names {names}): the folder says model_type 'qwen3' for serving stacks, so transformers made a plain "
        f"{type(assistant).__name__} of it, its embeddings and LM head fresh and the drafter's own parts left out "
        "(its load report lists them), which would draft at random. Load the drafter as one: hf_domino.DominoForSpeculation.from_pretrained(path) "
        "(any Domino or DFlash checkpoint), or, for a folder saved by hf-domino, "
        "AutoModel.from_pretrained(path, trust_remote_code=True)."
    )


def _refuse_per_token_state(generation_config: GenerationConfig) -> None:
    """Refuses the settings whose decoding keeps state that advances once per generated token.

    Verification scores every draft of a block with the logits processors, rejected drafts included, so a processor
    must be a function of the sequence it is given. Two of transformers' are not: classifier-free guidance runs the
    target again on a cache of its own, and SynthID's watermark keeps the last tokens and the contexts it has seen.
    After a rejection both would go on from tokens that were never generated, and the output would differ from the
    target alone's (transformers' own assistants and prompt lookup give such outputs without a word). DoLa is its own
    decoding mode, which transformers drops with a warning when an assistant is passed.
    """
    if generation_config.guidance_scale is not None and generation_config.guidance_scale != 1:
        raise ValueError(
            f"guidance_scale={generation_config.guidance_scale}: classifier-free guidance runs the target a second "
            "time inside a logits processor whose cache advances one token per call, and verifying a block calls it "
            "for every draft, rejected ones too, so the output would not be the target alone's. Drop "
            "assistant_model for guided generation, or guidance_scale with the drafter."
        )
    if isinstance(generation_config.watermarking_config, SynthIDTextWatermarkingConfig):
        raise ValueError(
            "watermarking_config=SynthIDTextWatermarkingConfig(...): SynthID's logits processor keeps the last tokens "
            "and the contexts it has seen, advanced once per call, and verifying a block calls it for every draft, "
            "rejected ones too, so the watermark and the output would not be the target alone's. Generate "
            "SynthID-watermarked text without assistant_model (WatermarkingConfig's watermark works with a drafter)."
        )
    if generation_config.dola_layers is not None:
        raise ValueError(
            f"dola_layers={generation_config.dola_layers!r}: DoLa is a decoding mode of its own "
            "(custom_generate='transformers-community/dola'), which transformers drops with a warning when an "
            "assistant is passed. Drop assistant_model for DoLa, or dola_layers with the drafter."
        )


__all__ = [
    "OTHER_ASSISTANT_SETTINGS",
    "DominoGenerationStats",
    "DominoOptions",
    "check_drafter_config_for_target_config",
    "check_drafter_for_target",
    "check_synced_gpus",
    "refuse_a_drafter_built_as_another_model",
]
