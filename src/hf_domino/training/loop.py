"""The training loop: `train` a drafter against a frozen target, with checkpoints it resumes from bit-for-bit.

One script for one CPU, one GPU or many processes under `accelerate launch` (DDP; FSDP in docs/training.md). What
makes resuming exact:

- nothing random depends on the global RNG or on history: which examples a process reads at a step
  (`example_indices`) and where its anchors fall (`data.anchor_generator`) are functions of `(seed, step)` only;
- a checkpoint is accelerate's state (`Accelerator.save_state`: optimizer, learning-rate schedule, RNG states,
  grad scaler) plus the drafter itself, written with `save_pretrained` so that every `checkpoint-{step}/` also loads
  with `DominoForSpeculation.from_pretrained` (`run_folder`: what a run's folder holds, and how a run takes it up).

Also here: `init_from_target_layers` (the warm start from the target's top layers) and the per-window metrics that
`log.jsonl` and `validation.jsonl` record.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..modeling_domino import DominoForSpeculation, TargetModules
from ..options_domino import check_drafter_config_for_target_config
from .data import (
    Example,
    FeatureCache,
    anchor_generator,
    check_token_ids,
    collate,
    data_digests,
    sample_anchors,
    sample_chain_anchors,
    target_hidden_states,
    within_max_length,
)
from .loss import DominoLossOutput, DominoTrainingModule, curriculum_lambda
from .run_folder import (
    FINAL_DIR,
    LOG_FILE,
    VALIDATION_LOG_FILE,
    check_fresh_start,
    check_resumable,
    latest_checkpoint,
    load_checkpoint,
    load_log_window,
    save_checkpoint,
    trim_logs,
    validated_steps,
)

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel


@dataclass
class TrainConfig:
    """Optimization settings of `train` (the drafter architecture lives in its `DominoConfig`)."""

    total_steps: int = 1000
    batch_size: int = 1  # sequences per process and micro step
    gradient_accumulation_steps: int = 1
    num_anchors: int = 16  # blocks per sequence
    max_length: int = 1024
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    curriculum: bool = True
    kl_weight: float = 0.0  # share of the loss that distills the target's whole next-token distribution
    draft_vocab: bool = False  # train and score drafts over the drafter's draft vocabulary only (FR-Spec)
    anchor_chain: bool = False  # anchors drawn among generate()'s own blocks over each answer, not uniformly
    generate_tau: bool = False  # validation also logs generate()'s own acceptance on the held-out answers
    seed: int = 0
    log_every: int = 10
    save_every: int = 100
    keep_checkpoints: int = 2
    gradient_checkpointing: bool = False
    stop_after_seconds: float | None = None  # checkpoint and return early (training in stages)

    def __post_init__(self) -> None:
        counts = ("total_steps", "batch_size", "gradient_accumulation_steps", "num_anchors", "max_length",
                  "log_every", "save_every", "keep_checkpoints")  # fmt: skip
        for name in counts:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}.")
        shares = {"warmup_ratio": self.warmup_ratio, "kl_weight": self.kl_weight}
        for name, value in shares.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(
                    f"TrainConfig.{name} is a share of the steps or of the loss, from 0 to 1; got {value!r}."
                )
        positive = {"learning_rate": self.learning_rate, "max_grad_norm": self.max_grad_norm}
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"TrainConfig.{name} must be a positive number, got {value!r}.")


def example_indices(
    step: int, micro_step: int, rank: int, *, config: TrainConfig, world_size: int, num_examples: int
) -> list[int]:
    """Which examples a process reads at (optimizer step, micro step): a function of the seed and position only.

    Epoch e visits the examples in the order of a permutation seeded by `seed + e`; consecutive global positions go
    to consecutive micro steps and ranks. Stateless, so resuming needs nothing but the step.
    """
    per_step = config.batch_size * config.gradient_accumulation_steps * world_size
    first = step * per_step + (micro_step * world_size + rank) * config.batch_size
    indices = []
    for position in range(first, first + config.batch_size):
        epoch, offset = divmod(position, num_examples)
        indices.append(int(_epoch_order(config.seed + epoch, num_examples)[offset]))
    return indices


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, num_examples: int) -> torch.Tensor:
    # Kept: a permutation of a million examples takes most of a second, and every sequence of a step asks for one.
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed))


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float):
    """Linear warmup over the first `warmup_ratio` of the steps, then cosine decay to 0 (transformers' schedule)."""
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, round(total_steps * warmup_ratio), total_steps)


# =================================================================================================== initialization
def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} keeps no `layers` list in its base model; initialize the drafter randomly "
            "(leave out --init-from-target)."
        )
    return layers


# A Llama or Mistral layer has no q/k norms; the drafter's keep their fresh (identity) values.
FRESH_IN_DRAFT_LAYERS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def _check_copyable(draft_layer: nn.Module, target_layer: nn.Module, target_name: str) -> None:
    """Raises unless the target's decoder layer computes what a draft layer does with the same weights: the same
    parameter names and shapes (biases, fused projections, extra norms or experts would be dropped or misplaced), and
    RMS norms that scale by their weight (Gemma's scale by 1 + weight; LayerNorm subtracts a mean)."""
    source, own = target_layer.state_dict(), draft_layer.state_dict()
    extra = [name for name in source if name not in own or own[name].shape != source[name].shape]
    missing = [name for name in own if name not in source and name not in FRESH_IN_DRAFT_LAYERS]
    differences = []
    if extra:
        differences.append(f"have weights a Qwen3 layer lacks ({', '.join(extra[:4])})")
    if missing:
        differences.append(f"lack weights of a Qwen3 layer ({', '.join(missing[:4])})")
    problem = "its decoder layers " + "; ".join(differences) if differences else None
    if problem is None:
        norm, own_norm = target_layer.input_layernorm, draft_layer.input_layernorm
        probe = torch.randn(2, own_norm.weight.shape[0], dtype=own_norm.weight.dtype, device=own_norm.weight.device)
        copied = copy.deepcopy(own_norm).requires_grad_(False)
        copied.weight.copy_(norm.weight)
        if not torch.allclose(norm(probe), copied(probe), rtol=1e-4, atol=1e-5):
            problem = f"its {type(norm).__name__} does not scale by its weight as the drafter's RMS norm does"
    if problem is not None:
        raise ValueError(
            f"--init-from-target copies the target's top decoder layers into the drafter's (Qwen3) layers, which "
            f"needs layers that compute the same with the same weights; {target_name} cannot: {problem}. Initialize "
            "the drafter randomly (leave out --init-from-target)."
        )


@torch.no_grad()
def init_from_target_layers(drafter: DominoForSpeculation, target_model: PreTrainedModel) -> list[int]:
    """Start the draft layers as copies of the target's top layers; returns the target layers copied.

    Draft layer i becomes target layer `L - n + i`, and the context projection starts as "read the deepest context
    layer, normalized as the first copied layer would": with `target_layer_ids[-1] == L - n - 1`, draft layer 0 then
    sees exactly the keys and values the target's layer `L - n` computes over the context. The block's queries start
    from token embeddings instead of deep hidden states, so this is a warm start, not a working drafter; on a small
    CPU budget it learns much faster than a random one (docs/training.md). Weights the target lacks (the q/k norms of
    a Llama target) keep their fresh values.
    """
    config = drafter.config
    target_layers = _decoder_layers(target_model)
    first = len(target_layers) - config.num_hidden_layers
    if first < 0:
        raise ValueError(
            f"The drafter has {config.num_hidden_layers} layers but the target only {len(target_layers)}; "
            "use fewer --num-draft-layers or drop --init-from-target."
        )
    _check_copyable(drafter.layers[0], target_layers[first], type(target_model).__name__)
    for draft_layer, target_layer in zip(drafter.layers, target_layers[first:]):
        draft_layer.load_state_dict(target_layer.state_dict(), strict=False)
    hidden = config.hidden_size
    deepest = config.target_layer_ids.index(max(config.target_layer_ids))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden)
    drafter.hidden_norm.weight.copy_(target_layers[first].input_layernorm.weight)
    target_norm = getattr(getattr(target_model, target_model.base_model_prefix, target_model), "norm", None)
    if target_norm is not None:
        drafter.norm.weight.copy_(target_norm.weight)
    return list(range(first, len(target_layers)))


# ============================================================================================================ train
def scored_vocab(drafter: DominoForSpeculation, config: TrainConfig) -> torch.Tensor | None:
    """The columns drafts are trained and scored over: the drafter's draft vocabulary with `config.draft_vocab`."""
    if not config.draft_vocab:
        return None
    if drafter.draft_vocab is None:
        raise ValueError(
            "TrainConfig(draft_vocab=True) trains over the drafter's draft vocabulary, but it has none: give it one "
            "with drafter.set_draft_vocab(...) (`hf-domino train --draft-vocab FILE`)."
        )
    return drafter.draft_vocab


def default_accelerator() -> Accelerator:
    """accelerate's own settings where they are given (`accelerate launch`, `ACCELERATE_USE_CPU`,
    `ACCELERATE_MIXED_PRECISION`); else the GPU under bf16 autocast when there is one, the CPU in fp32 otherwise."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = parse_flag_from_env("ACCELERATE_USE_CPU")
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if precision is None:
        precision = "bf16" if PartialState(cpu=cpu).device.type == "cuda" else "no"
    return Accelerator(cpu=cpu, mixed_precision=precision)


def prepare_training(
    accelerator: Accelerator, drafter: DominoForSpeculation, target_model: PreTrainedModel, config: TrainConfig
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The drafter's training module, its optimizer and its schedule, on `accelerator`'s device and prepared by it;
    the frozen target moved there too."""
    device = accelerator.device
    target_model.requires_grad_(False).eval().to(device)
    drafter.to(device).train()
    if config.gradient_checkpointing:
        if hasattr(drafter, "activation_checkpointing_enable"):  # transformers >= 5.x name
            drafter.activation_checkpointing_enable({"use_reentrant": False})
        else:
            drafter.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad],
        lr=config.learning_rate,
        weight_decay=config.weight_decay,
    )
    scheduler = cosine_schedule(optimizer, config.total_steps, config.warmup_ratio)
    vocab = scored_vocab(drafter, config)  # where the drafter now is
    module = DominoTrainingModule(drafter, TargetModules.from_target(target_model), vocab)
    module, optimizer = accelerator.prepare(module, optimizer)
    # The scheduler stays unprepared (accelerate's wrapper steps it once per process, which breaks the schedule);
    # registering it puts it in the checkpoints all the same.
    accelerator.register_for_checkpointing(scheduler)
    return module, optimizer, scheduler


def micro_batch_inputs(
    accelerator: Accelerator,
    module: nn.Module,
    target_model: PreTrainedModel,
    examples: Sequence[Example],
    feature_cache: FeatureCache | None,
    config: TrainConfig,
    step: int,
    micro_step: int,
    pad_token_id: int,
    mask_dtype: torch.dtype,
) -> dict[str, torch.Tensor | None]:
    """What the training module reads for one micro step of this process: its examples (`example_indices`), the
    target's features of them (precomputed, or from the target's forward here, with its last hidden state for
    distillation) and the blocks' anchors, all functions of `(seed, step, micro_step, rank)` only."""
    device, rank = accelerator.device, accelerator.process_index
    indices = example_indices(
        step, micro_step, rank, config=config, world_size=accelerator.num_processes, num_examples=len(examples)
    )
    features = [feature_cache.get(i) for i in indices] if feature_cache is not None else None
    batch = collate([examples[i] for i in indices], pad_token_id, features)
    input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    last_hidden = None
    if batch.context_features is None:
        # Under the mixed-precision autocast: on a GPU the frozen target's forward is most of a step.
        with accelerator.autocast():
            context_features, last_hidden = target_hidden_states(
                target_model,
                input_ids,
                attention_mask,
                accelerator.unwrap_model(module).drafter.config.target_layer_ids,
            )
    else:
        context_features = batch.context_features.to(device)
    generator = anchor_generator(config.seed, (step * config.gradient_accumulation_steps + micro_step) * 1024 + rank)
    loss_mask = batch.loss_mask.to(device)
    if config.anchor_chain:  # where generate() starts its blocks (a no-grad pass over every anchor first)
        with accelerator.autocast():
            chains = accelerator.unwrap_model(module).generate_blocks(
                input_ids, loss_mask, attention_mask, context_features, mask_dtype
            )
        anchors, anchor_valid = sample_chain_anchors(chains, config.num_anchors, generator)
    else:
        anchors, anchor_valid = sample_anchors(batch.loss_mask, config.num_anchors, generator)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "context_features": context_features,
        "anchors": anchors.to(device),
        "anchor_valid": anchor_valid.to(device),
        "target_last_hidden": last_hidden,
    }


def train(
    drafter: DominoForSpeculation,
    target_model: PreTrainedModel,
    examples: Sequence[Example],
    config: TrainConfig,
    output_dir: str | os.PathLike,
    *,
    feature_cache: FeatureCache | None = None,
    accelerator: Accelerator | None = None,
    resume: bool = True,
    pad_token_id: int = 0,
    validation_examples: Sequence[Example] = (),
) -> DominoForSpeculation:
    """Trains `drafter` against the frozen `target_model` on regenerated `examples`; returns the (unwrapped) drafter.

    Checkpoints go to `output_dir/checkpoint-{step}`; with `resume`, training continues from the latest one, exactly
    as if it had never stopped. Logs go to `output_dir/log.jsonl` and the console. Returns after `total_steps`
    optimizer steps, or earlier (with a checkpoint) once `stop_after_seconds` have passed.

    With `validation_examples` (held out from `examples`), every checkpoint also logs their losses, per-position
    accuracies and teacher-forced acceptance to `output_dir/validation.jsonl` (same fields as `log.jsonl`), with
    fixed anchors and in-process target features, without touching any training randomness.

    Runs where `accelerator` (default: `default_accelerator()`) puts it; `target_model` and `drafter` move there.
    """
    # Bad data, settings or folders are refused before anything is written.
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train() takes its settings as a TrainConfig, got {type(config).__name__}.")
    check_drafter_config_for_target_config(drafter.config, target_model.config)
    scored_vocab(drafter, config)
    kept = within_max_length(examples, config.max_length, "examples")
    if feature_cache is not None and kept != list(examples):  # its rows are looked up by example number
        raise ValueError(
            f"With a feature_cache, examples must be those it was filled for, each within max_length "
            f"({config.max_length}) with two response tokens or more: load them with load_examples(paths, max_length)."
        )
    examples = kept
    validation_examples = within_max_length(validation_examples, config.max_length, "validation_examples", empty=True)
    check_token_ids([*examples, *validation_examples], target_model.get_input_embeddings().num_embeddings)
    if accelerator is not None and (accelerator._models or accelerator._optimizers or accelerator._custom_objects):
        # Its checkpoints would hold both runs' optimizers and schedules, and a fresh process could not resume them.
        raise ValueError(
            "train() prepares the drafter, its optimizer and its schedule on the accelerator it is given, and this "
            "one holds another run's already: pass a fresh Accelerator to each train() call."
        )
    accelerator = accelerator or default_accelerator()
    output_dir = Path(output_dir)
    data = data_digests(examples, validation_examples)
    checkpoint = latest_checkpoint(output_dir) if resume else None
    if checkpoint is not None:
        check_resumable(
            checkpoint, drafter, config, accelerator.num_processes, data=data,
            mixed_precision=accelerator.mixed_precision,
        )  # fmt: skip
    elif not resume or (output_dir / FINAL_DIR).exists():
        # Resuming with no checkpoint: a run that stopped before its first one (its log records are dropped), or,
        # beside a final drafter, a finished run whose checkpoints were removed, which is no run to add to.
        check_fresh_start(output_dir)
    accelerator.wait_for_everyone()  # every process has checked before the main one trims the logs
    output_dir.mkdir(parents=True, exist_ok=True)
    module, optimizer, scheduler = prepare_training(accelerator, drafter, target_model, config)
    step = 0
    window: dict[str, torch.Tensor] = {}
    if checkpoint is not None:
        step = load_checkpoint(accelerator, checkpoint)
        window = load_log_window(accelerator, checkpoint)
        accelerator.print(f"Resumed from {checkpoint} at step {step}.")
    if accelerator.is_main_process:
        trim_logs(output_dir, step)
    accelerator.wait_for_everyone()
    mask_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)

    start_time = time.perf_counter()

    def validate(step: int, lam: float) -> None:
        held_out = held_out_window(accelerator, module, target_model, validation_examples, config, lam, pad_token_id)
        lr = scheduler.get_last_lr()[0]
        log_validation(accelerator, output_dir, metrics_record(accelerator, held_out, step, lam, lr, 0.0, start_time))

    if checkpoint is not None and validation_examples and step not in validated_steps(output_dir):
        # The stage that saved it stopped while validating it: its record is made now, as it would have been then.
        validate(step, curriculum_lambda(step - 1, config.total_steps, config.curriculum))
    while step < config.total_steps:
        lam = curriculum_lambda(step, config.total_steps, config.curriculum)
        step_weight = torch.zeros(1, device=accelerator.device)
        for micro_step in range(config.gradient_accumulation_steps):
            inputs = micro_batch_inputs(
                accelerator, module, target_model, examples, feature_cache, config, step, micro_step, pad_token_id,
                mask_dtype,
            )  # fmt: skip
            last_micro = micro_step == config.gradient_accumulation_steps - 1
            with contextlib.nullcontext() if last_micro else accelerator.no_sync(module):
                with accelerator.autocast():
                    out = module(**inputs, lam=lam, mask_dtype=mask_dtype, kl_weight=config.kl_weight)
                # The weighted sum, divided below by the whole step's weight (`mean_over_the_step`).
                accelerator.backward(out.loss * out.label_weight)
            step_weight += out.label_weight
            accumulate_metrics(window, out)
        mean_over_the_step(accelerator, module, step_weight)
        grad_norm = accelerator.clip_grad_norm_(module.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        lr = scheduler.get_last_lr()[0]

        if step % config.log_every == 0 or step == config.total_steps:
            record = metrics_record(accelerator, window, step, lam, lr, grad_norm, start_time)
            # The last batch's padded length: on a GPU, attention kernels may plan each new shape (docs/training.md).
            record["seq_len"] = int(inputs["input_ids"].shape[1])
            window = {}
            _append_record(accelerator, output_dir / LOG_FILE, record, _console_line(record))
        out_of_time = _agree(accelerator, config.stop_after_seconds, time.perf_counter() - start_time)
        if step % config.save_every == 0 or step == config.total_steps or out_of_time:
            # Saved before validating: a stage cut short during the (minutes-long) validation keeps its steps.
            # Validation draws its anchors from its own seeded generators, so the order leaves resumption exact.
            save_checkpoint(accelerator, module, output_dir, step, config, data=data, log_window=window)
            if validation_examples:
                validate(step, lam)
        if out_of_time and step < config.total_steps:
            accelerator.print(f"Stopping at step {step} after {config.stop_after_seconds:.0f}s; rerun to resume.")
            break
    return accelerator.unwrap_model(module).drafter


@torch.no_grad()
def mean_over_the_step(accelerator: Accelerator, module: nn.Module, step_weight: torch.Tensor) -> None:
    """Turns the gradients of the step's weighted loss sums into those of its weighted mean over every label of
    every micro step and process: the step a batch of all of them at once would take.

    A mean per micro step, averaged, weighed a micro step (or a process) of a few short answers' labels as much as one
    of many; DDP has already averaged the processes' sums, hence the factor of their number.
    """
    total = accelerator.reduce(step_weight, reduction="sum").clamp(min=1e-6)
    scale = accelerator.num_processes / total
    for parameter in module.parameters():
        if parameter.grad is not None:
            parameter.grad.mul_(scale.to(parameter.grad.dtype))


# ========================================================================================================== metrics
def accumulate_metrics(window: dict[str, torch.Tensor], out: DominoLossOutput) -> None:
    """Adds one forward's loss sums and counts to a logging window (summed over processes by `metrics_record`)."""
    values = {
        "base_loss": out.base_loss.detach().float().view(1),
        "final_loss": out.final_loss.detach().float().view(1),
        "losses": torch.ones(1, device=out.loss.device),
        "base_correct": out.base_correct,
        "final_correct": out.final_correct,
        "counts": out.counts,
        "accepted": out.accepted.view(1),
        "num_blocks": out.num_blocks.view(1),
    }
    for key, value in values.items():
        window[key] = window[key] + value if key in window else value.clone()


def metrics_record(
    accelerator: Accelerator,
    window: dict[str, torch.Tensor],
    step: int,
    lam: float,
    lr: float,
    grad_norm: float | torch.Tensor,
    start_time: float,
) -> dict[str, Any]:
    """One `log.jsonl` record: the window's mean losses, per-position accuracies and teacher-forced tau (and, for a
    validation window with `generate_tau`, the acceptance generate() has on the held-out answers)."""
    totals = {key: accelerator.reduce(value, reduction="sum").cpu() for key, value in window.items()}
    counts = totals["counts"].clamp(min=1)
    return {
        "step": step,
        "lam": round(lam, 6),
        "lr": lr,
        "grad_norm": float(grad_norm),
        "base_loss": float(totals["base_loss"] / totals["losses"]),
        "final_loss": float(totals["final_loss"] / totals["losses"]),
        "base_acc": [round(float(x), 4) for x in totals["base_correct"] / counts],
        "final_acc": [round(float(x), 4) for x in totals["final_correct"] / counts],
        "train_tau": float(totals["accepted"] / totals["num_blocks"].clamp(min=1)),
        **(
            {"generate_tau": float(totals["generate_accepted"] / totals["generate_blocks"].clamp(min=1))}
            if "generate_blocks" in totals
            else {}
        ),
        "elapsed_s": round(time.perf_counter() - start_time, 3),
    }


def held_out_window(
    accelerator: Accelerator,
    module: nn.Module,
    target_model: PreTrainedModel,
    examples: Sequence[Example],
    config: TrainConfig,
    lam: float,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Loss sums over held-out examples, with anchors fixed per example; every process runs it (DDP forwards sync).

    With `config.generate_tau`, also the blocks greedy `generate()` drafts over each held-out answer and the tokens
    they add (`DominoTrainingModule.generate_blocks`): on regenerated answers, generate()'s own acceptance.
    """
    device = accelerator.device
    layer_ids = accelerator.unwrap_model(module).drafter.config.target_layer_ids
    window: dict[str, torch.Tensor] = {}
    was_training = module.training
    module.eval()
    with torch.no_grad(), accelerator.autocast():
        for index, example in enumerate(examples):
            batch = collate([example], pad_token_id)
            input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            features, last_hidden = target_hidden_states(target_model, input_ids, attention_mask, layer_ids)
            anchors, anchor_valid = sample_anchors(
                batch.loss_mask, config.num_anchors, anchor_generator(config.seed, index)
            )
            loss_mask = batch.loss_mask.to(device)
            out = module(
                input_ids,
                loss_mask,
                attention_mask,
                features,
                anchors.to(device),
                anchor_valid.to(device),
                lam,
                target_last_hidden=last_hidden,
                kl_weight=config.kl_weight,
            )
            accumulate_metrics(window, out)
            if config.generate_tau:
                (blocks,) = accelerator.unwrap_model(module).generate_blocks(
                    input_ids, loss_mask, attention_mask, features
                )
                added = sum(tokens for _, tokens in blocks)
                generated = {"generate_accepted": float(added), "generate_blocks": float(len(blocks))}
                for key, value in generated.items():
                    window[key] = window.get(key, torch.zeros(1, device=device)) + value
    module.train(was_training)
    return window


def _append_record(accelerator: Accelerator, path: Path, record: dict[str, Any], line: str) -> None:
    if accelerator.is_main_process:
        with open(path, "a") as file:
            file.write(json.dumps(record) + "\n")
        print(line, flush=True)


def log_validation(accelerator: Accelerator, output_dir: Path, record: dict[str, Any]) -> None:
    """A held-out window's record to `validation.jsonl` and the console (no learning rate or gradient norm)."""
    record = {key: value for key, value in record.items() if key not in ("lr", "grad_norm")}
    line = f"validation step {record['step']}: base {record['base_loss']:.4f} | final {record['final_loss']:.4f}"
    line += f" | tau~{record['train_tau']:.2f}"
    if "generate_tau" in record:
        line += f" | generate() tau {record['generate_tau']:.2f}"
    _append_record(accelerator, output_dir / VALIDATION_LOG_FILE, record, line)


def _agree(accelerator: Accelerator, budget: float | None, elapsed: float) -> bool:
    """All processes stop together: the slowest clock decides."""
    if budget is None:
        return False
    flag = torch.tensor([float(elapsed >= budget)], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def _console_line(record: dict[str, Any]) -> str:
    head = ", ".join(f"{x:.2f}" for x in record["final_acc"][:4])
    return (
        f"step {record['step']:>6} | lam {record['lam']:.3f} | lr {record['lr']:.2e} | base {record['base_loss']:.4f}"
        f" | final {record['final_loss']:.4f} | acc[0:4] {head} | tau~{record['train_tau']:.2f}"
        f" | {record['elapsed_s']:.0f}s"
    )
