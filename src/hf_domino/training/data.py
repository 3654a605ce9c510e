"""What a training step reads: regenerated examples, the target's context features, batches and blocks.

Examples come from `hf-domino regenerate` jsonl files or from packed files (`packed`). The drafter's context input is
the frozen target's hidden states at `target_layer_ids`, computed in-process (`target_context_features`) or once for
all runs and epochs (`FeatureCache`, float16 on disk). Every sequence then carries many blocks at random anchors
inside its response (`sample_anchors`), and `build_block_inputs` turns each anchor into the block's input ids,
positions, labels and the teacher-forced GRU input.

Randomness here always comes from an explicit `torch.Generator` (`anchor_generator`), never from the global RNG, so
that a resumed run draws exactly the anchors it would have drawn had it never stopped.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..modeling_domino import context_features
from ..prompt_sets import InputDataError
from .packed import iter_records

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# ========================================================================================================= examples
@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on response tokens


def load_examples(paths: str | os.PathLike | Sequence[str | os.PathLike], max_length: int) -> list[Example]:
    """Reads `hf-domino regenerate` jsonl files or packed files (`hf-domino pack`), cutting sequences to `max_length`.

    Records with fewer than two response tokens left (no usable anchor) are dropped; a line cut short by a running
    regeneration is ignored. An example found twice (in a packed file and the jsonl it was packed from, given
    together) is read once, with a warning: twice, it weighed double, and could be held out and trained on at once.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    # Each record's mask is as long as its ids (`packed.iter_records` checks).
    records = [Example(record["input_ids"], record["loss_mask"]) for path in paths for record in iter_records(path)]
    examples = _without_repeats(within_max_length(records, max_length, empty=True), paths)
    if not examples:
        raise InputDataError(
            f"No usable training examples in {', '.join(str(p) for p in paths)}: each needs two response tokens or "
            f"more within the first {max_length} tokens (--max-length). Pass answers `hf-domino regenerate` wrote."
        )
    return examples


def _without_repeats(examples: list[Example], paths: Sequence[str | os.PathLike]) -> list[Example]:
    """`examples` with each one's later repeats (same ids, same mask) left out, in their order."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for example in examples:
        key = (ids_digest(example.input_ids), ids_digest(example.loss_mask))
        if key not in seen:
            seen.add(key)
            kept.append(example)
    if len(kept) < len(examples):
        warnings.warn(
            f"{len(examples) - len(kept)} of the {len(examples)} examples in {', '.join(str(p) for p in paths)} "
            "appear more than once (a packed file beside the jsonl it was packed from?): each is read once.",
            stacklevel=3,
        )
    return kept


def within_max_length(
    examples: Sequence[Example], max_length: int, name: str = "examples", empty: bool = False
) -> list[Example]:
    """`examples` cut to `max_length` tokens, without those left with fewer than two response tokens (no usable
    anchor); an error for anything but a sequence of `Example`s, or (unless `empty`) for nothing left."""
    if isinstance(examples, (str, os.PathLike)) or not all(isinstance(example, Example) for example in examples):
        raise TypeError(
            f"{name} must be a list of training.Example (load_examples(path, max_length) reads them from files), got "
            f"{type(examples).__name__}."
        )
    cut = [Example(e.input_ids[:max_length], e.loss_mask[:max_length]) for e in examples]
    kept = [example for example in cut if sum(example.loss_mask) >= 2]
    if not kept and not empty:
        raise InputDataError(
            f"None of the {len(examples)} {name} has two response tokens or more within {max_length} tokens: nothing "
            "to train on."
        )
    return kept


def check_token_ids(examples: Sequence[Example], vocab_size: int) -> None:
    """Refuses examples holding a token id the target's embedding has no row for (data of another tokenizer)."""
    for number, example in enumerate(examples):
        largest = max(example.input_ids, default=0)
        if largest >= vocab_size or min(example.input_ids, default=0) < 0:
            bad = largest if largest >= vocab_size else min(example.input_ids)
            raise InputDataError(
                f"Training example {number} holds token id {bad}, outside the target's vocabulary of {vocab_size}: "
                "the data was tokenized for another model. Regenerate it with this --target."
            )


# ================================================================================================= target features
@torch.no_grad()
def target_hidden_states(
    target_model: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    layer_ids: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's context features (`target_context_features`) and the target's last (final-norm) hidden state.

    The last hidden state and the target's LM head give its next-token distribution at any position, which the
    distillation loss reads (`loss.target_next_token_probs`) from the same forward.
    """
    outputs = target_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True,
        use_cache=False,
        logits_to_keep=1,  # the LM head over every position would cost a fifth of the forward for nothing
    )
    return context_features(outputs.hidden_states, layer_ids), outputs.hidden_states[-1]


def target_context_features(
    target_model: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    layer_ids: Sequence[int],
) -> torch.Tensor:
    """The target's hidden states after each layer in `layer_ids`, concatenated: `[b, T, len(layer_ids) * hidden]`."""
    return target_hidden_states(target_model, input_ids, attention_mask, layer_ids)[0]


def ids_digest(input_ids: Sequence[int]) -> str:
    """A short digest of an example's token ids: which example a cached row belongs to."""
    return hashlib.blake2b(np.asarray(input_ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def data_digests(examples: Sequence[Example], validation_examples: Sequence[Example]) -> dict[str, str]:
    """What a checkpoint records of the data it was trained on, and a resumed run must read again."""
    return {"examples": examples_digest(examples), "validation examples": examples_digest(validation_examples)}


def examples_digest(examples: Sequence[Example]) -> str:
    """A digest of examples in their order (ids and masks): what a resumed run must read to continue its run."""
    digest = hashlib.blake2b(digest_size=8)
    for example in examples:
        digest.update(np.asarray([len(example.input_ids)], dtype=np.int64).tobytes())
        digest.update(np.asarray(example.input_ids, dtype=np.int64).tobytes())
        digest.update(np.asarray(example.loss_mask, dtype=np.int8).tobytes())
    return digest.hexdigest()


@torch.no_grad()
def target_fingerprint(target_model: PreTrainedModel) -> str:
    """A digest of the target's first embedding rows and of its norms' weights, rounded to bfloat16: tells another
    model (or a fine-tune of it) from the same one loaded on another device or in float32 or bfloat16 (float16 rounds
    some weights to other bfloat16 values), without reading every weight."""
    digest = hashlib.blake2b(digest_size=8)
    parts = [("embed", target_model.get_input_embeddings().weight[:256])]
    parts += [(name, weight) for name, weight in target_model.named_parameters() if "norm" in name]
    for name, weight in parts:
        digest.update(name.encode())
        digest.update(weight.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


class FeatureCache:
    """Target context features precomputed once, on disk (float16, one row per token), for repeated or shared use.

    Layout of the folder: `meta.json` (layer ids, width, max_length and the target's fingerprint), `features.f16`
    (rows appended example after example) and `index.jsonl` (one `{"example", "offset", "length", "ids"}` line per
    finished example, `ids` a digest of its token ids), so that filling it resumes after an interruption, and a cache
    filled for another target or other data is refused rather than read.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "meta.json").read_text())
        self.width = self.meta["width"]
        self.index: dict[int, tuple[int, int]] = {}
        self.digests: dict[int, str] = {}  # caches filled before digests were kept have none
        index_path = self.directory / "index.jsonl"
        if index_path.exists():
            # The last element is "" or a line cut short by an interrupted write: skip it either way.
            for line in index_path.read_text().split("\n")[:-1]:
                if line.strip():
                    entry = json.loads(line)
                    self.index[entry["example"]] = (entry["offset"], entry["length"])
                    if "ids" in entry:
                        self.digests[entry["example"]] = entry["ids"]
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
        target_model: PreTrainedModel,
        examples: Sequence[Example],
        layer_ids: Sequence[int],
        max_length: int,
        progress: bool = True,
    ) -> FeatureCache:
        """Computes (or completes) the cache for `examples`, one target forward per example."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        hidden_size = target_model.config.get_text_config().hidden_size
        meta = {
            "layer_ids": list(layer_ids),
            "width": len(layer_ids) * hidden_size,
            "max_length": max_length,
            "target": target_fingerprint(target_model),
        }
        meta_path = directory / "meta.json"
        with open(directory / ".lock", "w") as lock:
            # Several runs may share one cache: one fills it at a time, the others then find it complete.
            fcntl.flock(lock, fcntl.LOCK_EX)
            if meta_path.exists():
                recorded = json.loads(meta_path.read_text())
                # A cache from before fingerprints were kept is checked on what it recorded.
                if differing := [key for key in recorded if recorded[key] != meta.get(key)]:
                    raise InputDataError(
                        f"{directory} holds features made otherwise than this run's ({', '.join(differing)} differ; "
                        "`target` is a digest of the target's embeddings and norms): give a new --feature-cache "
                        "folder, or remove that one."
                    )
            else:
                meta_path.write_text(json.dumps(meta))
            cls._check_examples(directory, examples)
            cls._fill(directory, target_model, examples, layer_ids, meta, progress)
        return cls(directory)

    @classmethod
    def _check_examples(cls, directory: Path, examples: Sequence[Example]) -> None:
        """Refuses a cache whose rows for an example index were computed from other token ids."""
        cache = cls(directory)
        for i, digest in cache.digests.items():
            if i < len(examples) and digest != ids_digest(examples[i].input_ids):
                raise InputDataError(
                    f"{directory} holds the features of other examples than this run's (example {i} differs: other "
                    "--data or --max-length): give a new --feature-cache folder, or remove "
                    "that one."
                )

    @classmethod
    def _fill(cls, directory: Path, target_model, examples, layer_ids, meta, progress) -> None:
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
        device = target_model.device
        with open(features_path, "ab") as rows_file, open(index_path, "a") as index_file:
            for count, i in enumerate(todo, start=1):
                ids = torch.tensor([examples[i].input_ids], device=device)
                features = target_context_features(target_model, ids, torch.ones_like(ids), layer_ids)[0]
                half = features.float().clamp(-65000, 65000).cpu().numpy().astype(np.float16)
                rows_file.write(half.tobytes())
                rows_file.flush()
                entry = {
                    "example": i,
                    "offset": rows_done,
                    "length": len(half),
                    "ids": ids_digest(examples[i].input_ids),
                }
                index_file.write(json.dumps(entry) + "\n")
                index_file.flush()
                rows_done += len(half)
                if progress and (count % 50 == 0 or count == len(todo)):
                    elapsed = time.perf_counter() - start
                    print(f"features: {count}/{len(todo)} examples, {rows_done} rows, {elapsed:.0f}s", flush=True)


# ========================================================================================================== batches
@dataclass
class Batch:
    input_ids: torch.LongTensor  # [b, T], right-padded
    loss_mask: torch.Tensor  # [b, T]
    attention_mask: torch.Tensor  # [b, T]
    context_features: torch.Tensor | None  # [b, T, F] when taken from a FeatureCache


def collate(examples: Sequence[Example], pad_token_id: int, features: Sequence[torch.Tensor] | None = None) -> Batch:
    """Right-pads examples (and their cached features, if given) into one batch."""
    seq_len = max(len(example.input_ids) for example in examples)
    input_ids = torch.full((len(examples), seq_len), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(examples), seq_len), dtype=torch.long)
    attention_mask = torch.zeros((len(examples), seq_len), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example.input_ids)
        input_ids[row, :length] = torch.tensor(example.input_ids)
        loss_mask[row, :length] = torch.tensor(example.loss_mask)
        attention_mask[row, :length] = 1
    batch_features = None
    if features is not None:
        batch_features = torch.zeros((len(examples), seq_len, features[0].shape[-1]))
        for row, rows in enumerate(features):
            batch_features[row, : len(rows)] = rows
    return Batch(input_ids, loss_mask, attention_mask, batch_features)


# ========================================================================================================== blocks
def anchor_generator(seed: int, stream: int) -> torch.Generator:
    """The generator of one batch's anchors: a function of the run's seed and the batch's place in the run only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def usable_anchors(loss_mask: torch.Tensor) -> torch.BoolTensor:
    """`[b, T]`: where a block can start, a response token followed by another one (see `sample_anchors`)."""
    mask = loss_mask.bool()
    usable = torch.zeros_like(mask)
    usable[:, :-1] = mask[:, :-1] & mask[:, 1:]
    return usable


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
    usable = usable_anchors(loss_mask)
    scores = torch.rand(usable.shape, generator=generator).to(usable.device)
    scores = scores.masked_fill(~usable, -1.0)
    num_anchors = min(num_anchors, usable.shape[1])
    top_scores, anchors = scores.topk(num_anchors, dim=1)
    valid = top_scores >= 0
    anchors = anchors.masked_fill(~valid, 0)
    # Invalid slots sort last so that the valid anchors stay in position order.
    order = (anchors + (~valid) * usable.shape[1]).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def generate_chain(acceptance: Sequence[int], first: int) -> list[tuple[int, int]]:
    """The blocks greedy `generate()` with whole blocks drafts over a sequence, as `(anchor, tokens added)`, from
    `acceptance[p]`, the tokens a block anchored at `p` adds (0 where no block can start).

    The first block is anchored at `first` (the prefill's token), each next one where the previous one's tokens end.
    The last block is left out: the sequence's end cuts it short, as `max_new_tokens` cuts generate()'s.
    """
    blocks, position = [], first
    while position < len(acceptance) and acceptance[position] > 0:
        blocks.append((position, acceptance[position]))
        position += acceptance[position]
    return blocks[:-1]


def sample_chain_anchors(
    chains: Sequence[Sequence[tuple[int, int]]], num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Up to `num_anchors` distinct anchors per sequence drawn uniformly among `generate()`'s own (`generate_chain`),
    in `sample_anchors`' layout: `(anchors [b, m], valid [b, m])`, sorted, invalid slots last (anchor 0)."""
    anchors = torch.zeros(len(chains), num_anchors, dtype=torch.long)
    valid = torch.zeros(len(chains), num_anchors, dtype=torch.bool)
    for row, chain in enumerate(chains):
        scores = torch.rand(len(chain), generator=generator)
        picked = sorted(chain[i][0] for i in scores.argsort(descending=True)[:num_anchors].tolist())
        anchors[row, : len(picked)] = torch.tensor(picked, dtype=torch.long)
        valid[row, : len(picked)] = True
    return anchors, valid


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
