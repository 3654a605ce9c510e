"""Training Domino drafters against a frozen target (`hf-domino train`).

The recipe (Domino paper, section 4.2 and appendix A.1):

- the target is frozen and supplies the context features (its hidden states at `target_layer_ids`) of sequences whose
  responses it generated itself (`hf-domino regenerate`);
- every sequence carries many blocks at random anchors inside its response. Block j sees the context features
  strictly before its anchor and its own block bidirectionally, never another block: all blocks of a batch go through
  ONE drafter forward over `[context ; block_1 ; ... ; block_m]` with an additive attention mask;
- block input ids are `[anchor, MASK, ...]`; draft k (0-based) predicts the token at `anchor + k + 1` under both label
  conventions (`shift_label` only changes how many block positions are drafts);
- the Domino head is teacher-forced: its GRU reads `[anchor, y_0, ..., y_{D-2}]` (ground truth), and draft k uses
  the state after `anchor, y_0, ..., y_{k-1}`; the first `pure_draft_prefix_len` drafts use the base logits alone;
- `loss = (1 - lam) * L_final + lam * L_base`, with `lam` annealed linearly from 1 to 0 (the base-anchored
  curriculum; `--no-curriculum` keeps lam = 0), and both cross-entropies weight draft k by `exp(-k / block_size)`.

The same script runs on one CPU, one GPU or many processes under `accelerate launch` (DDP; see docs/training.md for
FSDP). Everything random is derived from `(seed, step)`, so an interrupted run resumes bit-for-bit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .configuration_domino import DominoConfig
from .modeling_domino import DominoForSpeculation, TargetModules

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

LOG_FILE = "log.jsonl"
VALIDATION_LOG_FILE = "validation.jsonl"
STATE_FILE = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
CHECKPOINT_PREFIX = "checkpoint-"


# ================================================================================================== block construction
def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Draws up to `num_anchors` distinct anchor positions per sequence, uniformly among the usable ones.

    An anchor is usable when it and the token after it are response tokens: at inference the anchor is always a token
    the target produced, and a block whose first label is masked teaches nothing.

    Args:
        loss_mask: `[b, T]`, 1 on response tokens (0 on prompt and padding).
        num_anchors: blocks per sequence, `m`.
        generator: source of randomness (a CPU generator).

    Returns:
        `(anchors [b, m], valid [b, m])`, sorted by position; slots beyond a short sequence's usable positions are
        invalid (anchor 0), so that every batch has the same shape.
    """
    mask = loss_mask.bool()
    usable = torch.zeros_like(mask)
    usable[:, :-1] = mask[:, :-1] & mask[:, 1:]
    scores = torch.rand(usable.shape, generator=generator).to(usable.device)
    scores = scores.masked_fill(~usable, -1.0)
    num_anchors = min(num_anchors, usable.shape[1])
    top_scores, anchors = scores.topk(num_anchors, dim=1)
    valid = top_scores >= 0
    anchors = anchors.masked_fill(~valid, 0)
    # Invalid slots sort last so that the valid anchors stay in position order.
    order = (anchors + (~valid) * usable.shape[1]).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


@dataclass
class BlockInputs:
    """Tensors describing `m` blocks per sequence (`B` = block_size, `D` = drafts per block)."""

    block_ids: torch.LongTensor  # [b, m, B]: [anchor, MASK, ...]
    position_ids: torch.LongTensor  # [b, m, B]: anchor .. anchor + B - 1
    labels: torch.LongTensor  # [b, m, D]: the token at anchor + k + 1
    label_mask: torch.BoolTensor  # [b, m, D]: the label is a response token of a valid block
    gru_ids: torch.LongTensor  # [b, m, D]: teacher-forced GRU input [anchor, y_0, ..., y_{D-2}]


def build_block_inputs(
    input_ids: torch.LongTensor,
    loss_mask: torch.Tensor,
    anchors: torch.LongTensor,
    anchor_valid: torch.BoolTensor,
    *,
    block_size: int,
    num_drafts: int,
    mask_token_id: int,
) -> BlockInputs:
    """Block inputs, labels and GRU inputs for the blocks starting at `anchors`.

    Draft k predicts the token at `anchor + k + 1` under both conventions: with `shift_label` the drafts are block
    positions 0..B-1, without it positions 1..B-1 (position i predicts `anchor + i`). Labels past the sequence end or
    outside the response are masked.
    """
    seq_len = input_ids.shape[1]
    offsets = torch.arange(num_drafts + 1, device=input_ids.device)
    # Column 0 is the anchor, column k + 1 the label of draft k.
    positions = anchors.unsqueeze(-1) + offsets  # [b, m, D + 1]
    in_range = positions < seq_len
    gather_positions = positions.clamp(max=seq_len - 1).flatten(1)
    tokens = input_ids.gather(1, gather_positions).view(positions.shape)
    in_response = loss_mask.bool().gather(1, gather_positions).view(positions.shape)
    labels = tokens[..., 1:]
    label_mask = (in_range & in_response)[..., 1:] & anchor_valid.unsqueeze(-1)

    block_ids = torch.full((*anchors.shape, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    block_ids[..., 0] = tokens[..., 0]
    position_ids = anchors.unsqueeze(-1) + torch.arange(block_size, device=input_ids.device)
    return BlockInputs(
        block_ids=block_ids,
        position_ids=position_ids,
        labels=labels.masked_fill(~label_mask, 0),
        label_mask=label_mask,
        gru_ids=tokens[..., :-1],
    )


def block_attention_mask(
    anchors: torch.LongTensor,
    context_mask: torch.Tensor,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Additive mask `[b, 1, m * B, T + m * B]` over keys `[context ; block_1 ; ... ; block_m]`.

    A query of block j sees the context positions strictly before its anchor (the anchor's own features do not exist
    at inference time) that are not padding, and all of block j; nothing of the other blocks.
    """
    batch_size, num_blocks = anchors.shape
    seq_len = context_mask.shape[1]
    device = anchors.device
    context_positions = torch.arange(seq_len, device=device)
    sees_context = (context_positions.view(1, 1, seq_len) < anchors.unsqueeze(-1)) & context_mask.bool().unsqueeze(1)
    block_of = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    sees_block = block_of.view(-1, 1) == block_of.view(1, -1)  # [m*B, m*B]: block diagonal
    allowed = torch.cat(
        [
            sees_context.repeat_interleave(block_size, dim=1),  # [b, m*B, T]
            sees_block.expand(batch_size, -1, -1),
        ],
        dim=-1,
    )
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def position_weights(num_drafts: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Loss weight of draft k: `exp(-k / block_size)`. Late drafts matter less: they count only if all before do."""
    return torch.exp(-torch.arange(num_drafts, dtype=torch.float32, device=device) / block_size)


def curriculum_lambda(step: int, total_steps: int, enabled: bool = True) -> float:
    """Weight of the base loss at optimizer step `step` (0-based): 1 at the first step, linearly down to 0 at the last.

    Without the curriculum the base logits get no direct loss (lam = 0), which lets the backbone drift into serving
    the head only (the collapse of the paper's Fig. 4).
    """
    if not enabled:
        return 0.0
    return max(0.0, 1.0 - step / max(total_steps - 1, 1))


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


@torch.no_grad()
def init_from_target_layers(drafter: DominoForSpeculation, target: PreTrainedModel) -> list[int]:
    """Start the draft layers as copies of the target's top layers; returns the target layers copied.

    Draft layer i becomes target layer `L - n + i`, and the context projection starts as "read the deepest context
    layer, normalized as the first copied layer would": with `target_layer_ids[-1] == L - n - 1`, draft layer 0 then
    sees exactly the keys and values the target's layer `L - n` computes over the context. The block's queries start
    from token embeddings instead of deep hidden states, so this is a warm start, not a working drafter; on a small
    CPU budget it learns much faster than a random one (docs/training.md). Weights the target lacks (the q/k norms of
    a Llama target) keep their fresh values.
    """
    config = drafter.config
    target_layers = _decoder_layers(target)
    first = len(target_layers) - config.num_hidden_layers
    if first < 0:
        raise ValueError(
            f"The drafter has {config.num_hidden_layers} layers but the target only {len(target_layers)}; "
            "use fewer --num-draft-layers or drop --init-from-target."
        )
    for draft_layer, target_layer in zip(drafter.layers, target_layers[first:]):
        source = target_layer.state_dict()
        own = draft_layer.state_dict()
        shared = {name: tensor for name, tensor in source.items() if name in own and own[name].shape == tensor.shape}
        draft_layer.load_state_dict(shared, strict=False)
    hidden = config.hidden_size
    deepest = config.target_layer_ids.index(max(config.target_layer_ids))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden)
    drafter.hidden_norm.weight.copy_(target_layers[first].input_layernorm.weight)
    target_norm = getattr(getattr(target, target.base_model_prefix, target), "norm", None)
    if target_norm is not None:
        drafter.norm.weight.copy_(target_norm.weight)
    return list(range(first, len(target_layers)))


# ======================================================================================================= the losses
@dataclass
class DominoLossOutput:
    loss: torch.Tensor  # (1 - lam) * final_loss + lam * base_loss
    base_loss: torch.Tensor
    final_loss: torch.Tensor
    base_correct: torch.Tensor  # [D] correct base argmaxes per draft position (summed over blocks)
    final_correct: torch.Tensor  # [D] same for the final (head-corrected) logits
    counts: torch.Tensor  # [D] valid labels per draft position
    accepted: torch.Tensor  # sum over valid blocks of 1 + leading correct final drafts (teacher-forced tau)
    num_blocks: torch.Tensor  # valid blocks


def domino_losses(
    base_logits: torch.Tensor,
    final_logits: torch.Tensor,
    labels: torch.LongTensor,
    label_mask: torch.BoolTensor,
    weights: torch.Tensor,
    lam: float,
) -> DominoLossOutput:
    """Position-weighted cross-entropies of the base and final logits and their curriculum mix.

    Args:
        base_logits, final_logits: `[N, D, V]` for N blocks (float32 is best: the vocabulary is large).
        labels, label_mask: `[N, D]`.
        weights: `[D]`, see `position_weights`.
        lam: base-loss weight, see `curriculum_lambda`.
    """
    mask = label_mask.float()
    weight = weights.view(1, -1) * mask
    denominator = weight.sum().clamp(min=1e-6)

    def weighted_ce(logits: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
        return (ce * weight).sum() / denominator

    base_loss = weighted_ce(base_logits)
    final_loss = weighted_ce(final_logits)
    with torch.no_grad():
        base_hit = (base_logits.argmax(-1) == labels) & label_mask
        final_hit = (final_logits.argmax(-1) == labels) & label_mask
        block_valid = label_mask[:, 0]
        accepted = (final_hit.long().cumprod(dim=1).sum(dim=1) + 1) * block_valid
    return DominoLossOutput(
        loss=(1.0 - lam) * final_loss + lam * base_loss,
        base_loss=base_loss,
        final_loss=final_loss,
        base_correct=base_hit.sum(0).float(),
        final_correct=final_hit.sum(0).float(),
        counts=mask.sum(0),
        accepted=accepted.sum().float(),
        num_blocks=block_valid.sum().float(),
    )


def draft_logits(
    drafter: DominoForSpeculation,
    target: TargetModules,
    context_features: torch.Tensor,
    context_mask: torch.Tensor,
    blocks: BlockInputs,
    anchors: torch.LongTensor,
    mask_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced base and final logits of every draft of every block, `[b * m, D, V]` each.

    All blocks of the batch share one backbone forward; the head then runs on the ground-truth block tokens, so its
    sequential GRU becomes one `nn.GRU` call over `[anchor, y_0, ..., y_{D-2}]`.
    """
    config = drafter.config
    batch_size, num_blocks, block_size = blocks.block_ids.shape
    seq_len = context_features.shape[1]
    block_embeds = target.embed(blocks.block_ids.view(batch_size, -1), drafter.dtype, drafter.device)
    context_positions = torch.arange(seq_len, device=anchors.device).expand(batch_size, -1)
    position_ids = torch.cat([context_positions, blocks.position_ids.view(batch_size, -1)], dim=1)
    attention_mask = block_attention_mask(anchors, context_mask, block_size, dtype=mask_dtype)
    block_hidden = drafter(block_embeds, context_features, position_ids, attention_mask=attention_mask)
    draft_hidden = drafter.draft_hidden_states(block_hidden.view(batch_size * num_blocks, block_size, -1))
    base_logits = target.logits(draft_hidden).float()
    if not config.has_domino_head:
        return base_logits, base_logits

    gru_weight = drafter.prefix_gru.weight_ih_l0
    gru_inputs = target.embed(blocks.gru_ids.flatten(0, 1), gru_weight.dtype, gru_weight.device)
    # Output k of the GRU is its state after reading anchor, y_0 .. y_{k-1}: exactly what draft k sees at inference.
    states, _ = drafter.prefix_gru(gru_inputs)
    correction = drafter.logit_correction(draft_hidden, states.transpose(0, 1)).float()
    head_on = torch.arange(correction.shape[1], device=correction.device) >= config.pure_draft_prefix_len
    final_logits = base_logits + correction * head_on.view(1, -1, 1)
    return base_logits, final_logits


class DominoTrainingModule(nn.Module):
    """Wraps a drafter so that one `forward` computes the losses: what DDP/FSDP wrap and `accelerate` prepares.

    The frozen target modules are kept as a plain attribute (not a submodule), so they are neither trained, synced,
    sharded nor saved with the drafter.
    """

    def __init__(self, drafter: DominoForSpeculation, target: TargetModules):
        super().__init__()
        self.drafter = drafter
        self.target = target

    def forward(
        self,
        input_ids: torch.LongTensor,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        context_features: torch.Tensor,
        anchors: torch.LongTensor,
        anchor_valid: torch.BoolTensor,
        lam: float,
        mask_dtype: torch.dtype = torch.float32,
    ) -> DominoLossOutput:
        config = self.drafter.config
        blocks = build_block_inputs(
            input_ids,
            loss_mask,
            anchors,
            anchor_valid,
            block_size=config.block_size,
            num_drafts=config.num_drafts,
            mask_token_id=config.mask_token_id,
        )
        base_logits, final_logits = draft_logits(
            self.drafter, self.target, context_features, attention_mask, blocks, anchors, mask_dtype
        )
        weights = position_weights(config.num_drafts, config.block_size, device=base_logits.device)
        return domino_losses(
            base_logits,
            final_logits,
            blocks.labels.flatten(0, 1),
            blocks.label_mask.flatten(0, 1),
            weights,
            lam,
        )


# ============================================================================================================= data
@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]


def load_examples(paths: str | os.PathLike | Sequence[str | os.PathLike], max_length: int) -> list[Example]:
    """Reads `hf-domino regenerate` jsonl files, cutting sequences to `max_length` tokens.

    Records with fewer than two response tokens left (no usable anchor) are dropped; a line cut short by a running
    regeneration is ignored.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    examples = []
    for path in paths:
        with open(path, encoding="utf-8") as file:
            for line in file:
                if not line.endswith("\n"):
                    break
                if not line.strip():
                    continue
                record = json.loads(line)
                input_ids, loss_mask = record["input_ids"][:max_length], record["loss_mask"][:max_length]
                if sum(loss_mask) >= 2:
                    examples.append(Example(input_ids, loss_mask))
    if not examples:
        raise ValueError(f"No usable training examples in {[str(p) for p in paths]}.")
    return examples


@torch.no_grad()
def target_context_features(
    target: PreTrainedModel, input_ids: torch.LongTensor, attention_mask: torch.Tensor, layer_ids: Sequence[int]
) -> torch.Tensor:
    """The target's hidden states after each layer in `layer_ids`, concatenated: `[b, T, len(layer_ids) * hidden]`."""
    outputs = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True,
        use_cache=False,
        logits_to_keep=1,  # the LM head over every position would cost a fifth of the forward for nothing
    )
    return torch.cat([outputs.hidden_states[i + 1] for i in layer_ids], dim=-1)


class FeatureCache:
    """Target context features precomputed once, on disk (float16, one row per token), for repeated or shared use.

    Layout of the folder: `meta.json` (layer ids, width, max_length), `features.f16` (rows appended example after
    example) and `index.jsonl` (one `{"example", "offset", "length"}` line per finished example), so that filling it
    resumes after an interruption.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "meta.json").read_text())
        self.width = self.meta["width"]
        self.index: dict[int, tuple[int, int]] = {}
        index_path = self.directory / "index.jsonl"
        if index_path.exists():
            # The last element is "" or a line cut short by an interrupted write: skip it either way.
            for line in index_path.read_text().split("\n")[:-1]:
                if line.strip():
                    entry = json.loads(line)
                    self.index[entry["example"]] = (entry["offset"], entry["length"])
        self._rows = None

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            self._rows = np.memmap(self.directory / "features.f16", dtype=np.float16, mode="r").reshape(-1, self.width)
        return self._rows

    def __contains__(self, example: int) -> bool:
        return example in self.index

    def get(self, example: int) -> torch.Tensor:
        offset, length = self.index[example]
        return torch.from_numpy(np.array(self.rows[offset : offset + length], dtype=np.float32))

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        directory: str | os.PathLike,
        target: PreTrainedModel,
        examples: Sequence[Example],
        layer_ids: Sequence[int],
        max_length: int,
        progress: bool = True,
    ) -> FeatureCache:
        """Computes (or completes) the cache for `examples`, one target forward per example."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        hidden_size = target.config.get_text_config().hidden_size
        meta = {"layer_ids": list(layer_ids), "width": len(layer_ids) * hidden_size, "max_length": max_length}
        meta_path = directory / "meta.json"
        with open(directory / ".lock", "w") as lock:
            # Several runs may share one cache: one fills it at a time, the others then find it complete.
            fcntl.flock(lock, fcntl.LOCK_EX)
            if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
                raise ValueError(f"{directory} holds features for {json.loads(meta_path.read_text())}, not {meta}.")
            if not meta_path.exists():
                meta_path.write_text(json.dumps(meta))
            cls._fill(directory, target, examples, layer_ids, meta, progress)
        return cls(directory)

    @classmethod
    def _fill(cls, directory: Path, target, examples, layer_ids, meta, progress) -> None:
        index_path = directory / "index.jsonl"
        if index_path.exists():
            complete = index_path.read_bytes().rfind(b"\n") + 1
            if complete != index_path.stat().st_size:
                with open(index_path, "r+b") as file:
                    file.truncate(complete)
        cache = cls(directory)
        features_path = directory / "features.f16"
        # Rows written after the last indexed example belong to an interrupted write: drop them.
        rows_done = max((offset + length for offset, length in cache.index.values()), default=0)
        row_bytes = meta["width"] * 2
        if features_path.exists() and features_path.stat().st_size != rows_done * row_bytes:
            with open(features_path, "r+b") as file:
                file.truncate(rows_done * row_bytes)
        todo = [i for i in range(len(examples)) if i not in cache]
        start = time.perf_counter()
        device = target.device
        with open(features_path, "ab") as rows_file, open(directory / "index.jsonl", "a") as index_file:
            for count, i in enumerate(todo, start=1):
                ids = torch.tensor([examples[i].input_ids], device=device)
                features = target_context_features(target, ids, torch.ones_like(ids), layer_ids)[0]
                half = features.float().clamp(-65000, 65000).cpu().numpy().astype(np.float16)
                rows_file.write(half.tobytes())
                rows_file.flush()
                index_file.write(json.dumps({"example": i, "offset": rows_done, "length": len(half)}) + "\n")
                index_file.flush()
                rows_done += len(half)
                if progress and (count % 50 == 0 or count == len(todo)):
                    elapsed = time.perf_counter() - start
                    print(f"features: {count}/{len(todo)} examples, {rows_done} rows, {elapsed:.0f}s", flush=True)


@dataclass
class Batch:
    input_ids: torch.LongTensor  # [b, T], right-padded
    loss_mask: torch.Tensor  # [b, T]
    attention_mask: torch.Tensor  # [b, T]
    context_features: torch.Tensor | None  # [b, T, F] when taken from a FeatureCache


def collate(examples: Sequence[Example], pad_token_id: int, features: Sequence[torch.Tensor] | None = None) -> Batch:
    seq_len = max(len(example.input_ids) for example in examples)
    input_ids = torch.full((len(examples), seq_len), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(examples), seq_len), dtype=torch.long)
    attention_mask = torch.zeros((len(examples), seq_len), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example.input_ids)
        input_ids[row, :length] = torch.tensor(example.input_ids)
        loss_mask[row, :length] = torch.tensor(example.loss_mask)
        attention_mask[row, :length] = 1
    context_features = None
    if features is not None:
        context_features = torch.zeros((len(examples), seq_len, features[0].shape[-1]))
        for row, rows in enumerate(features):
            context_features[row, : len(rows)] = rows
    return Batch(input_ids, loss_mask, attention_mask, context_features)


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
        order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(config.seed + epoch))
        indices.append(int(order[offset]))
    return indices


def anchor_generator(config: TrainConfig, step: int, micro_step: int, rank: int) -> torch.Generator:
    stream = (step * config.gradient_accumulation_steps + micro_step) * 1024 + rank
    return torch.Generator().manual_seed(config.seed * 1_000_003 + stream)


# ========================================================================================================= training
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
    seed: int = 0
    log_every: int = 10
    save_every: int = 100
    keep_checkpoints: int = 2
    gradient_checkpointing: bool = False
    stop_after_seconds: float | None = None  # checkpoint and return early (training in stages)


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    candidates = [
        path
        for path in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
        if (path / STATE_FILE).exists() and path.name[len(CHECKPOINT_PREFIX) :].isdigit()
    ]
    return max(candidates, key=lambda path: int(path.name[len(CHECKPOINT_PREFIX) :]), default=None)


def save_checkpoint(
    output_dir: Path,
    step: int,
    drafter: DominoForSpeculation,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    config: TrainConfig,
    keep: int,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Writes `checkpoint-{step}` (drafter as safetensors, optimizer/scheduler/RNG states) and prunes old ones.

    Written to a temporary folder first and renamed, so a crash never leaves a half checkpoint to resume from.
    `state_dict` overrides the drafter's own (the gathered full weights under FSDP).
    """
    path = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = output_dir / f".tmp-{CHECKPOINT_PREFIX}{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp, state_dict=state_dict)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    torch.save(state, tmp / STATE_FILE)
    (tmp / STATE_JSON).write_text(json.dumps({"step": step, "train_config": dataclasses.asdict(config)}, indent=2))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    checkpoints = sorted(
        (p for p in output_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.name[len(CHECKPOINT_PREFIX) :].isdigit()),
        key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]),
    )
    for old in checkpoints[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(
    path: Path, drafter: DominoForSpeculation, optimizer: torch.optim.Optimizer, scheduler: Any
) -> int:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    drafter.load_state_dict(weights, strict=True)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["cpu_rng"])
    if torch.cuda.is_available() and state["cuda_rng"]:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["step"])


def train(
    drafter: DominoForSpeculation,
    target: PreTrainedModel,
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
    """Trains `drafter` against the frozen `target` on regenerated `examples`; returns the (unwrapped) drafter.

    Checkpoints go to `output_dir/checkpoint-{step}`; with `resume`, training continues from the latest one, exactly
    as if it had never stopped. Logs go to `output_dir/log.jsonl` and the console. Returns after `total_steps`
    optimizer steps, or earlier (with a checkpoint) once `stop_after_seconds` have passed.

    With `validation_examples` (held out from `examples`), every checkpoint also logs their losses, per-position
    accuracies and teacher-forced acceptance to `output_dir/validation.jsonl` (same fields as `log.jsonl`), with
    fixed anchors and in-process target features, without touching any training randomness.
    """
    from accelerate import Accelerator

    if accelerator is None:
        accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    device = accelerator.device
    world_size, rank = accelerator.num_processes, accelerator.process_index

    target.requires_grad_(False).eval().to(device)
    target_modules = TargetModules.from_target(target)
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

    step = 0
    checkpoint = latest_checkpoint(output_dir) if resume else None
    if checkpoint is not None:
        step = load_checkpoint(checkpoint, drafter, optimizer, scheduler)
        accelerator.print(f"Resumed from {checkpoint} at step {step}.")
    # The scheduler stays unprepared: accelerate's wrapper steps it once per process, which breaks the schedule.
    module, optimizer = accelerator.prepare(DominoTrainingModule(drafter, target_modules), optimizer)
    mixed = accelerator.mixed_precision
    mask_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed, torch.float32)
    layer_ids = drafter.config.target_layer_ids

    start_time = time.perf_counter()
    window: dict[str, torch.Tensor] = {}
    while step < config.total_steps:
        lam = curriculum_lambda(step, config.total_steps, config.curriculum)
        for micro_step in range(config.gradient_accumulation_steps):
            indices = example_indices(
                step, micro_step, rank, config=config, world_size=world_size, num_examples=len(examples)
            )
            features = [feature_cache.get(i) for i in indices] if feature_cache is not None else None
            batch = collate([examples[i] for i in indices], pad_token_id, features)
            input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            if batch.context_features is None:
                context_features = target_context_features(target, input_ids, attention_mask, layer_ids)
            else:
                context_features = batch.context_features.to(device)
            anchors, anchor_valid = sample_anchors(
                batch.loss_mask, config.num_anchors, anchor_generator(config, step, micro_step, rank)
            )
            last_micro = micro_step == config.gradient_accumulation_steps - 1
            sync = contextlib.nullcontext() if last_micro else accelerator.no_sync(module)
            with sync:
                with accelerator.autocast():
                    out = module(
                        input_ids,
                        batch.loss_mask.to(device),
                        attention_mask,
                        context_features,
                        anchors.to(device),
                        anchor_valid.to(device),
                        lam,
                        mask_dtype,
                    )
                accelerator.backward(out.loss / config.gradient_accumulation_steps)
            _accumulate(window, out)
        grad_norm = accelerator.clip_grad_norm_(module.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % config.log_every == 0 or step == config.total_steps:
            record = _log_record(accelerator, window, step, lam, scheduler.get_last_lr()[0], grad_norm, start_time)
            window = {}
            if accelerator.is_main_process:
                with open(output_dir / LOG_FILE, "a") as file:
                    file.write(json.dumps(record) + "\n")
                print(_format_record(record), flush=True)
        out_of_time = _agree(accelerator, config.stop_after_seconds, time.perf_counter() - start_time)
        if step % config.save_every == 0 or step == config.total_steps or out_of_time:
            if validation_examples:
                held_out = _validation_window(
                    accelerator, module, target, validation_examples, config, lam, pad_token_id
                )
                record = _log_record(accelerator, held_out, step, lam, scheduler.get_last_lr()[0], 0.0, start_time)
                if accelerator.is_main_process:
                    record = {key: value for key, value in record.items() if key not in ("lr", "grad_norm")}
                    with open(output_dir / VALIDATION_LOG_FILE, "a") as file:
                        file.write(json.dumps(record) + "\n")
                    losses = f"base {record['base_loss']:.4f} | final {record['final_loss']:.4f}"
                    print(f"validation step {step}: {losses} | tau~{record['train_tau']:.2f}", flush=True)
            accelerator.wait_for_everyone()
            # A collective under FSDP (gathers the shards); the unwrapped weights otherwise.
            full_state = accelerator.get_state_dict(module)
            if accelerator.is_main_process:
                weights = {name.removeprefix("drafter."): tensor for name, tensor in full_state.items()}
                save_checkpoint(
                    output_dir, step, drafter, optimizer, scheduler, config, config.keep_checkpoints, weights
                )
            accelerator.wait_for_everyone()
        if out_of_time and step < config.total_steps:
            accelerator.print(f"Stopping at step {step} after {config.stop_after_seconds:.0f}s; rerun to resume.")
            break
    return accelerator.unwrap_model(module).drafter


def _accumulate(window: dict[str, torch.Tensor], out: DominoLossOutput) -> None:
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


def teacher_forced_metrics(
    drafter: DominoForSpeculation,
    target: PreTrainedModel,
    examples: Sequence[Example],
    config: TrainConfig | None = None,
    pad_token_id: int = 0,
) -> dict[str, Any]:
    """Losses (at lam = 0), per-position accuracies and teacher-forced tau of `drafter` on `examples`.

    The numbers `--validation-examples` logs, for any drafter and any regenerated examples (e.g. held-out prompts):
    anchors are fixed per example (`config.seed`, `config.num_anchors`), target features are computed in-process.
    """
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=drafter.device.type == "cpu")
    config = config or TrainConfig()
    module = DominoTrainingModule(drafter, TargetModules.from_target(target)).train(drafter.training)
    window = _validation_window(accelerator, module, target, examples, config, 0.0, pad_token_id)
    record = _log_record(accelerator, window, 0, 0.0, 0.0, 0.0, time.perf_counter())
    return {
        key: value
        for key, value in record.items()
        if key in ("base_loss", "final_loss", "base_acc", "final_acc", "train_tau")
    }


def _validation_window(
    accelerator: Accelerator,
    module: nn.Module,
    target: PreTrainedModel,
    examples: Sequence[Example],
    config: TrainConfig,
    lam: float,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Loss sums over held-out examples, with anchors fixed per example; every process runs it (DDP forwards sync)."""
    device = accelerator.device
    layer_ids = accelerator.unwrap_model(module).drafter.config.target_layer_ids
    window: dict[str, torch.Tensor] = {}
    was_training = module.training
    module.eval()
    with torch.no_grad(), accelerator.autocast():
        for index, example in enumerate(examples):
            batch = collate([example], pad_token_id)
            input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            features = target_context_features(target, input_ids, attention_mask, layer_ids)
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
            anchors, anchor_valid = sample_anchors(batch.loss_mask, config.num_anchors, generator)
            loss_mask = batch.loss_mask.to(device)
            out = module(
                input_ids, loss_mask, attention_mask, features, anchors.to(device), anchor_valid.to(device), lam
            )
            _accumulate(window, out)
    module.train(was_training)
    return window


def _agree(accelerator: Accelerator, budget: float | None, elapsed: float) -> bool:
    """All processes stop together: the slowest clock decides."""
    if budget is None:
        return False
    flag = torch.tensor([float(elapsed >= budget)], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def _log_record(accelerator, window, step, lam, lr, grad_norm, start_time) -> dict[str, Any]:
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
        "elapsed_s": round(time.perf_counter() - start_time, 1),
    }


def _format_record(record: dict[str, Any]) -> str:
    head = ", ".join(f"{x:.2f}" for x in record["final_acc"][:4])
    return (
        f"step {record['step']:>6} | lam {record['lam']:.3f} | lr {record['lr']:.2e} | base {record['base_loss']:.4f}"
        f" | final {record['final_loss']:.4f} | acc[0:4] {head} | tau~{record['train_tau']:.2f}"
        f" | {record['elapsed_s']:.0f}s"
    )


# ======================================================================================================= evaluation
@dataclass
class AcceptanceResult:
    mean_acceptance_length: float  # tokens per target forward while drafting, over all prompts
    per_prompt: list[float]
    new_tokens: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@torch.inference_mode()
def evaluate_acceptance(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: DominoForSpeculation,
    prompts: Sequence[list[dict[str, str]]],
    max_new_tokens: int = 128,
) -> AcceptanceResult:
    """Greedy (T=0) acceptance length of `drafter` on chat `prompts` through `target.generate(assistant_model=...)`.

    Acceptance length = tokens added per drafting iteration (accepted drafts + the target's own token), pooled over
    every iteration of every prompt. Switch the head off around the call (`with drafter.domino_head(False)`) for the
    DFlash-mode figure of the same weights.
    """
    drafter.eval()
    lengths, per_prompt, new_tokens = [], [], 0
    start = time.perf_counter()
    for messages in prompts:
        encoding = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        input_ids = encoding["input_ids"].to(target.device)
        output = target.generate(
            input_ids,
            attention_mask=encoding["attention_mask"].to(target.device),
            assistant_model=drafter,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        stats = drafter.last_generation_stats
        new_tokens += output.shape[1] - input_ids.shape[1]
        if stats is not None and stats.acceptance_lengths:
            lengths.extend(stats.acceptance_lengths)
            per_prompt.append(stats.mean_acceptance_length)
    return AcceptanceResult(
        mean_acceptance_length=sum(lengths) / max(len(lengths), 1),
        per_prompt=per_prompt,
        new_tokens=new_tokens,
        seconds=time.perf_counter() - start,
    )


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a training `log.jsonl`; on a resumed run, the latest record of each step wins."""
    records: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[record["step"]] = record
    return [records[step] for step in sorted(records)]


def plot_loss_curves(
    logs: dict[str, str | os.PathLike], output: str | os.PathLike, key: str | Sequence[str] = "base_loss"
) -> Path:
    """Plots `key` (default the base loss; or several keys) against the step for runs' logs into a PNG.

    Needs matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4), dpi=120)
    keys = [key] if isinstance(key, str) else list(key)
    for label, path in logs.items():
        records = read_log(path)
        for name in keys:
            curve_label = label if len(keys) == 1 else f"{label}: {name.replace('_', ' ')}"
            axis.plot([r["step"] for r in records], [r[name] for r in records], label=curve_label)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel(keys[0].replace("_", " ") if len(keys) == 1 else "loss")
    axis.set_yscale("log")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    plt.close(figure)
    return output


# ============================================================================================================== CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the `hf-domino train` options."""
    target = parser.add_argument_group("target")
    target.add_argument("--target", default="smollm2", help="Model id or folder, or `smollm2` (offline, default).")
    target.add_argument("--gguf-file", help="GGUF file inside --target.")

    data = parser.add_argument_group("data")
    data.add_argument("--data", nargs="+", type=Path, help="jsonl files written by `hf-domino regenerate`.")
    data.add_argument("--max-examples", type=int, default=None, help="Use only the first examples of --data.")
    data.add_argument(
        "--validation-examples",
        type=int,
        default=0,
        help="Hold out the last N examples (after --max-examples): losses and tau~ at every checkpoint.",
    )
    data.add_argument("--max-length", type=int, default=1024, help="Cut sequences to this many tokens.")
    data.add_argument(
        "--features-only", action="store_true", help="Fill --feature-cache and exit (before concurrent runs)."
    )
    data.add_argument(
        "--feature-cache",
        type=Path,
        help="Folder of precomputed target features (filled first if incomplete). Without it, the target runs "
        "in-process at every step.",
    )

    model = parser.add_argument_group("drafter architecture (new drafters)")
    model.add_argument("--num-draft-layers", type=int, default=1)
    model.add_argument("--block-size", type=int, default=16)
    model.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    model.add_argument("--emb-dim", type=int, default=64)
    model.add_argument("--gru-hidden-dim", type=int, default=256)
    model.add_argument("--intermediate-size", type=int, default=None, help="Draft MLP width (default: target's).")
    model.add_argument("--pure-draft-prefix-len", type=int, default=1)
    model.add_argument("--no-domino-head", action="store_true", help="Train a plain DFlash drafter.")
    model.add_argument("--no-shift-label", action="store_true", help="DFlash label convention (B - 1 drafts).")
    model.add_argument("--init-from", type=Path, help="Start from this drafter checkpoint instead of a fresh one.")
    model.add_argument(
        "--init-from-target",
        action="store_true",
        help="Start the draft layers as copies of the target's top layers (init_from_target_layers).",
    )

    optim = parser.add_argument_group("optimization")
    optim.add_argument("--output-dir", type=Path, default=Path("runs/train"))
    optim.add_argument("--total-steps", type=int, default=1000)
    optim.add_argument("--batch-size", type=int, default=1, help="Sequences per process and micro step.")
    optim.add_argument("--gradient-accumulation-steps", type=int, default=1)
    optim.add_argument("--num-anchors", type=int, default=16, help="Blocks per sequence.")
    optim.add_argument("--lr", type=float, default=6e-4)
    optim.add_argument("--warmup-ratio", type=float, default=0.04)
    optim.add_argument("--max-grad-norm", type=float, default=1.0)
    optim.add_argument("--no-curriculum", action="store_true", help="Ablation: lam = 0 (no base loss) throughout.")
    optim.add_argument("--seed", type=int, default=0)
    optim.add_argument("--log-every", type=int, default=10)
    optim.add_argument("--save-every", type=int, default=100)
    optim.add_argument("--gradient-checkpointing", action="store_true")
    optim.add_argument("--stop-after-minutes", type=float, default=None, help="Checkpoint and stop (resume later).")
    optim.add_argument("--no-resume", action="store_true", help="Ignore checkpoints in --output-dir.")
    optim.add_argument("--threads", type=int, default=None, help="torch CPU threads per process.")
    optim.add_argument("--export-dir", type=Path, help="Export the finished drafter here (export_drafter).")

    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--eval-only", action="store_true", help="Measure acceptance lengths of --drafter.")
    evaluation.add_argument("--drafter", type=Path, help="Drafter folder to evaluate.")
    evaluation.add_argument("--eval-prompts", nargs="+", default=["mtbench", "humaneval"])
    evaluation.add_argument("--eval-limit", type=int, default=30)
    evaluation.add_argument("--max-new-tokens", type=int, default=128)
    evaluation.add_argument("--head", choices=["on", "off", "both"], default="both")
    evaluation.add_argument("--eval-output", type=Path, help="Write the results as json here.")


def run(args: argparse.Namespace) -> int:
    """Run `hf-domino train` with parsed arguments."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from accelerate import PartialState

    from .data import load_target

    target_model, tokenizer = load_target(args.target, gguf_file=args.gguf_file, device="cpu")
    if args.eval_only:
        return _run_eval(args, target_model, tokenizer)
    if not args.data:
        raise SystemExit("--data is required for training.")

    drafter = _drafter_from_args(args, target_model)
    examples = load_examples(args.data, args.max_length)
    if args.max_examples:
        examples = examples[: args.max_examples]
    validation: list[Example] = []
    if args.validation_examples:
        if not 0 < args.validation_examples < len(examples):
            raise SystemExit(
                f"--validation-examples {args.validation_examples} must be between 1 and the number of examples "
                f"minus one ({len(examples) - 1})."
            )
        examples, validation = examples[: -args.validation_examples], examples[-args.validation_examples :]
    feature_cache = None
    if args.feature_cache:
        # Safe to call from every process (and from concurrent runs): a file lock lets one fill it at a time.
        feature_cache = FeatureCache.build(
            args.feature_cache, target_model, examples, drafter.config.target_layer_ids, args.max_length
        )
        if args.features_only:
            return 0
    config = TrainConfig(
        total_steps=args.total_steps,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_anchors=args.num_anchors,
        max_length=args.max_length,
        learning_rate=args.lr,
        warmup_ratio=args.warmup_ratio,
        max_grad_norm=args.max_grad_norm,
        curriculum=not args.no_curriculum,
        seed=args.seed,
        log_every=args.log_every,
        save_every=args.save_every,
        gradient_checkpointing=args.gradient_checkpointing,
        stop_after_seconds=args.stop_after_minutes * 60 if args.stop_after_minutes else None,
    )
    PartialState().print(
        f"Training {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M-parameter drafter on {len(examples)} "
        f"examples ({sum(sum(e.loss_mask) for e in examples)} response tokens) for {config.total_steps} steps.",
        flush=True,
    )
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    drafter = train(
        drafter,
        target_model,
        examples,
        config,
        args.output_dir,
        feature_cache=feature_cache,
        resume=not args.no_resume,
        pad_token_id=pad_token_id,
        validation_examples=validation,
    )
    finished = latest_checkpoint(args.output_dir)
    is_main = PartialState().is_main_process
    if is_main and finished is not None and finished.name == f"{CHECKPOINT_PREFIX}{config.total_steps}":
        drafter.save_pretrained(args.output_dir / "final")
        if args.export_dir:
            from .export import export_drafter

            base_model = "HuggingFaceTB/SmolLM2-135M-Instruct" if args.target == "smollm2" else args.target
            export_drafter(drafter, args.export_dir, base_model=base_model, overwrite=True)
    return 0


def _drafter_from_args(args: argparse.Namespace, target_model: PreTrainedModel) -> DominoForSpeculation:
    """The drafter to train: a checkpoint (`--init-from`), or a fresh one shaped by the architecture flags."""
    if args.init_from and args.init_from_target:
        raise SystemExit("--init-from and --init-from-target exclude each other: pick one starting point.")
    if args.init_from:
        # fp32 master weights whatever the checkpoint was saved in (exports are often fp16).
        return DominoForSpeculation.from_pretrained(args.init_from, dtype=torch.float32)
    backbone = {"intermediate_size": args.intermediate_size} if args.intermediate_size else {}
    config = DominoConfig.from_target(
        target_model.config,
        num_hidden_layers=args.num_draft_layers,
        block_size=args.block_size,
        target_layer_ids=args.target_layer_ids,
        with_domino_head=not args.no_domino_head,
        emb_dim=args.emb_dim,
        gru_hidden_dim=args.gru_hidden_dim,
        pure_draft_prefix_len=args.pure_draft_prefix_len,
        shift_label=False if args.no_shift_label else None,
        **backbone,
    )
    torch.manual_seed(args.seed)
    drafter = DominoForSpeculation(config)
    if args.init_from_target:
        from accelerate import PartialState

        copied = init_from_target_layers(drafter, target_model)
        PartialState().print(f"Draft layers start as copies of target layers {copied}.")
    return drafter


def _run_eval(args: argparse.Namespace, target_model, tokenizer) -> int:
    from . import assets

    if args.drafter is None:
        raise SystemExit("--eval-only needs --drafter.")
    drafter = DominoForSpeculation.from_pretrained(args.drafter).eval()
    heads = {"on": [True], "off": [False], "both": [True, False]}[args.head]
    if not drafter.config.has_domino_head:
        heads = [False]
    results = {}
    for name in args.eval_prompts:
        prompts = assets.load_prompts(name, limit=args.eval_limit)
        for head in heads:
            with drafter.domino_head(head) if drafter.config.has_domino_head else contextlib.nullcontext():
                result = evaluate_acceptance(target_model, tokenizer, drafter, prompts, args.max_new_tokens)
            key = f"{Path(str(name)).stem}/head_{'on' if head else 'off'}"
            results[key] = result.to_dict()
            print(
                f"{key}: acceptance length {result.mean_acceptance_length:.3f} over {len(prompts)} prompts "
                f"({result.new_tokens} tokens, {result.seconds:.0f}s)",
                flush=True,
            )
    if args.eval_output:
        args.eval_output.parent.mkdir(parents=True, exist_ok=True)
        args.eval_output.write_text(json.dumps(results, indent=2))
    return 0


__all__ = [
    "AcceptanceResult",
    "BlockInputs",
    "DominoLossOutput",
    "DominoTrainingModule",
    "Example",
    "FeatureCache",
    "TrainConfig",
    "block_attention_mask",
    "build_block_inputs",
    "curriculum_lambda",
    "domino_losses",
    "draft_logits",
    "evaluate_acceptance",
    "init_from_target_layers",
    "load_examples",
    "plot_loss_curves",
    "position_weights",
    "read_log",
    "sample_anchors",
    "target_context_features",
    "teacher_forced_metrics",
    "train",
]
