"""How good is a drafter: teacher-forced metrics on regenerated data, acceptance through `generate()`, and logs.

- `teacher_forced_metrics`: losses, per-position accuracies and teacher-forced tau on any regenerated examples,
  the exact numbers `hf-domino train --validation-examples` logs, so that held-out data (or a finished drafter)
  can be scored the same way afterwards.
- `evaluate_acceptance`: the real thing, greedy acceptance length through `target_model.generate(...,
  assistant_model=drafter)`, counted by `hf_domino.acceptance`, the one acceptance metric the benchmark uses too.
- `read_log` / `plot_loss_curves`: a run's `log.jsonl`, resumed runs included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import assets
from ..acceptance import generate_with_acceptance, mean_acceptance_length
from ..modeling_domino import DominoForSpeculation, TargetModules
from ..prompt_sets import Messages
from .data import Example, check_token_ids, target_context_features, within_max_length
from .loop import TrainConfig, held_out_window, metrics_record, scored_vocab
from .loss import DominoTrainingModule

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TEACHER_FORCED_KEYS = ("base_loss", "final_loss", "base_acc", "final_acc", "train_tau")


def teacher_forced_metrics(
    drafter: DominoForSpeculation,
    target_model: PreTrainedModel,
    examples: Sequence[Example],
    config: TrainConfig | None = None,
    pad_token_id: int = 0,
) -> dict[str, Any]:
    """Losses (at lam = 0), per-position accuracies and teacher-forced tau of `drafter` on `examples`.

    The numbers `--validation-examples` logs, for any drafter and any regenerated examples (e.g. held-out prompts):
    anchors are fixed per example (`config.seed`, `config.num_anchors`), target features are computed in-process,
    and drafts are scored over the drafter's draft vocabulary with `config.draft_vocab`, as a run trained with it
    validates.
    With `config.generate_tau`, also `generate_tau`: on the target's own greedy answers, the acceptance greedy
    `generate()` with whole blocks has on their prompts (`DominoTrainingModule.generate_blocks`).
    """
    from accelerate import Accelerator

    config = config or TrainConfig()
    examples = within_max_length(examples, config.max_length, "examples")
    check_token_ids(examples, target_model.get_input_embeddings().num_embeddings)
    accelerator = Accelerator(cpu=drafter.device.type == "cpu")
    vocab = scored_vocab(drafter, config)
    module = DominoTrainingModule(drafter, TargetModules.from_target(target_model), vocab).train(drafter.training)
    window = held_out_window(accelerator, module, target_model, examples, config, 0.0, pad_token_id)
    record = metrics_record(accelerator, window, 0, 0.0, 0.0, 0.0, time.perf_counter())
    keys = (*TEACHER_FORCED_KEYS, "generate_tau") if config.generate_tau else TEACHER_FORCED_KEYS
    return {key: record[key] for key in keys}


@torch.no_grad()
def teacher_forced_acceptance(
    drafter: DominoForSpeculation,
    target_model: PreTrainedModel,
    input_ids: torch.LongTensor,
    anchors: Sequence[int],
    draft_vocab: bool = True,
) -> list[int]:
    """Tokens per target forward of a block at each of `anchors`, teacher-forced on the sequence `input_ids` `[1, T]`.

    Each block drafts every draft the sequence still has room for, with the target's features of the tokens before
    its anchor, and counts 1 + its leading drafts that match the sequence. On the output of a greedy
    `generate(..., assistant_model=drafter, draft_policy="fixed")` at its anchors (`acceptance.block_anchors`) this
    is generate()'s own acceptance, block for block: training's teacher forcing drafts exactly as inference does.
    Except the last block when generation stopped at `max_new_tokens`: generate() then drafts only what fits.
    `draft_vocab` as in generate(): over the drafter's draft vocabulary when it has one.
    """
    input_ids = input_ids.to(drafter.device)
    ones = torch.ones_like(input_ids)  # every token after an anchor is a label: generate() verifies whatever follows
    features = target_context_features(target_model, input_ids, ones, drafter.config.target_layer_ids)
    vocab = drafter.draft_vocab if draft_vocab else None
    module = DominoTrainingModule(drafter, TargetModules.from_target(target_model), vocab)
    anchor_ids = torch.tensor([list(anchors)], device=input_ids.device)
    valid = torch.ones_like(anchor_ids, dtype=torch.bool)
    return module.block_acceptance(input_ids, ones, ones, features, anchor_ids, valid)[0].tolist()


@dataclass
class AcceptanceResult:
    mean_acceptance_length: float  # tokens per target forward while drafting, over all prompts; nan: none drafted
    per_prompt: list[float]
    new_tokens: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        if math.isnan(self.mean_acceptance_length):
            values["mean_acceptance_length"] = None  # JSON has no NaN: no prompt drafted
        return values


@torch.inference_mode()
def evaluate_acceptance(
    target_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: DominoForSpeculation,
    prompts: Sequence[Messages],
    max_new_tokens: int = 128,
    draft_length: int | None = None,
) -> AcceptanceResult:
    """Greedy (T=0) acceptance length of `drafter` on chat `prompts` through `target_model.generate(assistant_model=)`.

    Acceptance length = tokens added per target forward after the prefill (accepted drafts + the target's own token),
    pooled over every forward of every prompt, as `hf_domino.acceptance` counts it for the benchmark. Every cycle
    drafts and verifies `draft_length` tokens (default: the whole block) under the fixed draft policy: the adaptive
    policy's short or skipped drafts would measure the policy, not the drafter. Switch the head off around the call
    (`with drafter.domino_head(False)`) for the DFlash-mode figure of the same weights. Prompts the target ends at
    their first token have no drafting forward and are left out; if every prompt ends so, the mean is nan.
    """
    if max_new_tokens < 2:
        raise ValueError(
            f"max_new_tokens must be at least 2, got {max_new_tokens!r}: the prefill's forward makes the first token, "
            "so only the tokens after it are drafted and measured."
        )
    if draft_length is not None and not 1 <= draft_length <= drafter.config.num_drafts:
        raise ValueError(
            f"draft_length must be from 1 to the drafter's {drafter.config.num_drafts} drafts per block (None: all of "
            f"them), got {draft_length!r}."
        )
    if isinstance(prompts, str) or not all(isinstance(m, (list, tuple)) and m for m in prompts):
        raise TypeError(
            "prompts must be a list of chat conversations, each a list of {'role', 'content'} messages, e.g. "
            "[[{'role': 'user', 'content': 'Hi'}]] (prompt_sets.load_prompts returns them so)."
        )
    drafter.eval()
    pad_token_id = assets.pad_token_id(target_model, tokenizer)
    lengths, per_prompt, new_tokens = [], [], 0
    start = time.perf_counter()
    for messages in prompts:
        input_ids = assets.encode_chat(tokenizer, messages).to(target_model.device)
        output, acceptance_lengths = generate_with_acceptance(
            target_model,
            input_ids,
            assistant_model=drafter,
            draft_policy="fixed",
            num_speculative_tokens=draft_length if draft_length is not None else drafter.config.num_drafts,
            domino_lookup=False,  # the drafter's own acceptance, not copies from the text
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        new_tokens += output.shape[1] - input_ids.shape[1]
        if acceptance_lengths:
            lengths.extend(acceptance_lengths)
            per_prompt.append(mean_acceptance_length(acceptance_lengths))
    return AcceptanceResult(
        mean_acceptance_length=mean_acceptance_length(lengths) if lengths else math.nan,
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
