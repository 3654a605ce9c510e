"""What a training run's folder holds, and how a run takes it up: `checkpoint-{step}/` folders (accelerate's state
plus the drafter, `save_checkpoint` / `load_checkpoint`), the settings each was trained with (`resume_differences`,
`check_resumable`), `log.jsonl` and `validation.jsonl` (`trim_logs`), and `final/`; `check_fresh_start` and
`clear_run` for a new run where another left its files.

A checkpoint is written to a temporary folder and renamed, so a crash never leaves half a checkpoint to resume from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..modeling_domino import DRAFT_VOCAB_FILE, DominoForSpeculation

if TYPE_CHECKING:
    from accelerate import Accelerator

    from .loop import TrainConfig

LOG_FILE = "log.jsonl"
VALIDATION_LOG_FILE = "validation.jsonl"
STATE_JSON = "trainer_state.json"
LEGACY_STATE_FILE = "trainer_state.pt"  # checkpoints written before they went through accelerate's state saving
LOG_WINDOW_FILE = "log_window_{rank}.pt"  # a process's metric sums since the last log record
CHECKPOINT_PREFIX = "checkpoint-"
FINAL_DIR = "final"  # where `hf-domino train` saves the drafter once the last step is done


def _checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The finished `checkpoint-{step}` folders of a run, oldest first."""
    paths = [
        path
        for path in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
        if path.name[len(CHECKPOINT_PREFIX) :].isdigit() and (path / STATE_JSON).exists()
    ]
    return sorted(paths, key=lambda path: int(path.name[len(CHECKPOINT_PREFIX) :]))


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    checkpoints = _checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def earlier_run(output_dir: str | os.PathLike) -> list[Path]:
    """What a run left in `output_dir`: its checkpoints (finished or cut short), logs and `final/` drafter."""
    output_dir = Path(output_dir)
    made = [
        path
        for prefix in (CHECKPOINT_PREFIX, f".tmp-{CHECKPOINT_PREFIX}")
        for path in output_dir.glob(f"{prefix}*")
        if path.is_dir() and path.name[len(prefix) :].isdigit()
    ]
    made += [output_dir / name for name in (LOG_FILE, VALIDATION_LOG_FILE, FINAL_DIR)]
    return sorted(path for path in made if path.exists())


def clear_run(output_dir: str | os.PathLike) -> None:
    """Removes what a run left in `output_dir` (`earlier_run`), so that a new one starts there; nothing else."""
    for path in earlier_run(output_dir):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


# Settings a resumed run may change: they decide what is logged and kept, or the memory a step takes (recomputed
# activations are the same: test_gradient_checkpointing_gives_the_same_step), not what is learned.
RESUME_FREE_SETTINGS = (
    "log_every", "save_every", "keep_checkpoints", "stop_after_seconds", "generate_tau", "gradient_checkpointing"
)  # fmt: skip
# Drafter config entries that describe a saved file rather than the drafter, or repeat others (`dflash_config`).
CONFIG_RECORD_KEYS = (
    "_name_or_path", "transformers_version", "architectures", "auto_map", "dtype", "torch_dtype", "dflash_config"
)  # fmt: skip


def resume_differences(
    checkpoint: Path,
    drafter: DominoForSpeculation,
    config: TrainConfig,
    num_processes: int,
    *,
    data: dict[str, str] | None = None,
    mixed_precision: str | None = None,
) -> list[str]:
    """How resuming `checkpoint` with this drafter, settings and number of processes (and, where given, data
    digests and mixed precision) would differ from the run that wrote it, one line per setting (empty: it continues
    that run exactly). A checkpoint that did not record something is not asked about it."""
    state = json.loads((checkpoint / STATE_JSON).read_text())
    recorded = state.get("train_config", {})
    differences = [
        f"{name} was {recorded[name]!r}, now {value!r}"
        for name, value in dataclasses.asdict(config).items()
        if name not in RESUME_FREE_SETTINGS and name in recorded and recorded[name] != value
    ]
    if state.get("num_processes", num_processes) != num_processes:
        differences.append(f"it ran on {state['num_processes']} processes, now {num_processes}")
    for name, digest in (data or {}).items():
        if state.get("data", {}).get(name, digest) != digest:
            differences.append(f"its {name} were others (--data, --max-examples, --validation-examples)")
    if mixed_precision is not None and state.get("mixed_precision", mixed_precision) != mixed_precision:
        differences.append(f"its mixed precision was {state['mixed_precision']!r}, now {mixed_precision!r}")
    saved = type(drafter.config).from_pretrained(checkpoint).to_dict()
    own = drafter.config.to_dict()
    differences += [
        f"the drafter's {key} was {saved.get(key)!r}, now {own.get(key)!r}"
        for key in sorted(saved.keys() | own.keys())
        if key not in CONFIG_RECORD_KEYS and saved.get(key) != own.get(key)
    ]
    if (checkpoint / DRAFT_VOCAB_FILE).exists() and drafter.draft_vocab is not None:
        from safetensors.torch import load_file

        if not torch.equal(load_file(checkpoint / DRAFT_VOCAB_FILE)["draft_vocab"].cpu(), drafter.draft_vocab.cpu()):
            differences.append("the drafter's draft vocabulary holds other tokens")
    return differences


def check_resumable(checkpoint: Path, *args: Any, **options: Any) -> None:
    """Refuses to resume `checkpoint` where the run would not continue as it began (`resume_differences`, which
    takes the other arguments), or where an older hf-domino wrote it."""
    if (checkpoint / LEGACY_STATE_FILE).exists():
        raise ValueError(
            f"{checkpoint} was written by an older hf-domino (before checkpoints used accelerate's state saving) and "
            f"cannot be resumed; start a new run from its weights with `--init-from {checkpoint}` in a fresh "
            "--output-dir."
        )
    if differences := resume_differences(checkpoint, *args, **options):
        raise ValueError(
            f"Resuming {checkpoint} continues its run exactly, which needs its settings, but {'; '.join(differences)}. "
            "Rerun with the settings it was trained with, or start a new run from its weights (`--init-from "
            f"{checkpoint}` in a new --output-dir)."
        )


def check_fresh_start(output_dir: str | os.PathLike) -> None:
    """Refuses to start a new run in a folder holding what another run left (`earlier_run`): pruning by step would
    delete the new run's (older-numbered) checkpoints, its logs would follow the other's, and a `final/` of the
    other would stand beside them."""
    if left := earlier_run(output_dir):
        names = ", ".join(path.name for path in left[:4]) + (", ..." if len(left) > 4 else "")
        raise ValueError(
            f"{output_dir} holds what an earlier run left ({names}); a new run there would mix its checkpoints and "
            "logs with them. Give a new output folder, resume that run, or remove what it left first "
            "(`hf-domino train --overwrite-output-dir`, `hf_domino.training.clear_run`)."
        )


def _logged_step(line: str) -> int:
    """The step a log line records (0 for a line that is not a record: kept, not ours to judge)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 0


def validated_steps(output_dir: Path) -> set[int]:
    """The steps `validation.jsonl` holds a record of."""
    path = output_dir / VALIDATION_LOG_FILE
    lines = path.read_text().split("\n") if path.exists() else []
    return {_logged_step(line) for line in lines if line.strip()}


def trim_logs(output_dir: Path, step: int) -> None:
    """Keeps the log records of steps up to `step` (where a run resumes), so that none is logged twice."""
    for path in (output_dir / LOG_FILE, output_dir / VALIDATION_LOG_FILE):
        if not path.exists():
            continue
        lines = path.read_text().split("\n")[:-1]  # a last line without its newline was cut short by a crash
        kept = [line for line in lines if line.strip() and _logged_step(line) <= step]
        if len(kept) != len(lines) or path.read_bytes()[-1:] not in (b"\n", b""):
            temporary = path.with_name(path.name + ".tmp")
            temporary.write_text("".join(line + "\n" for line in kept))
            os.replace(temporary, path)


def save_checkpoint(
    accelerator: Accelerator,
    module: nn.Module,
    output_dir: Path,
    step: int,
    config: TrainConfig,
    *,
    data: dict[str, str] | None = None,
    log_window: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Writes `checkpoint-{step}` (on every process: a collective) and prunes all but the last `keep_checkpoints`.

    `accelerator.save_state` writes the optimizer, the registered schedule and each process's RNG states (FSDP:
    its sharded model and optimizer as well); the drafter goes next to them through `save_pretrained`, with the
    full weights gathered by `accelerator.get_state_dict`, instead of accelerate's own copy of the wrapper's weights.
    Beside them: the digests of the run's `data`, its mixed precision, and each process's `log_window` (the sums of
    the steps since the last log record, which the next record after a resume must hold too).
    """
    path = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = output_dir / f".tmp-{CHECKPOINT_PREFIX}{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    hook = accelerator.register_save_state_pre_hook(lambda models, weights, directory: weights.clear())
    try:
        accelerator.save_state(str(tmp))
    finally:
        hook.remove()
    accelerator.wait_for_everyone()
    window = {key: value.cpu() for key, value in (log_window or {}).items()}
    torch.save(window, tmp / LOG_WINDOW_FILE.format(rank=accelerator.process_index))
    accelerator.wait_for_everyone()
    # A collective under FSDP (gathers the shards); the unwrapped weights otherwise.
    full_state = accelerator.get_state_dict(module)
    if accelerator.is_main_process:
        weights = {name.removeprefix("drafter."): tensor for name, tensor in full_state.items()}
        accelerator.unwrap_model(module).drafter.save_pretrained(tmp, state_dict=weights)
        state = {
            "step": step,
            "train_config": dataclasses.asdict(config),
            "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            **({"data": data} if data else {}),
        }
        (tmp / STATE_JSON).write_text(json.dumps(state, indent=2))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        for old in _checkpoints(output_dir)[: -config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator: Accelerator, path: Path) -> int:
    """Restores what `save_checkpoint` wrote into the prepared objects of `accelerator`; returns the step."""
    from safetensors.torch import load_file

    def load_drafter(models: list[nn.Module], directory: str) -> None:
        weights = {}
        # model.safetensors or its shards only: a drafter folder also holds draft_vocab/draft_datastore files.
        for file in sorted(Path(directory).glob("model*.safetensors")):
            weights.update(load_file(file))
        for model in models:
            accelerator.unwrap_model(model).drafter.load_state_dict(weights, strict=True)
        models.clear()  # accelerate would look for a weights file of its own (FSDP never gets here: it has one)

    hook = accelerator.register_load_state_pre_hook(load_drafter)
    try:
        accelerator.load_state(str(path))
    finally:
        hook.remove()
    return int(json.loads((path / STATE_JSON).read_text())["step"])


def load_log_window(accelerator: Accelerator, path: Path) -> dict[str, torch.Tensor]:
    """This process's sums since the last log record as `save_checkpoint` kept them (none in older checkpoints)."""
    window_file = path / LOG_WINDOW_FILE.format(rank=accelerator.process_index)
    if not window_file.exists():
        return {}
    return {key: value.to(accelerator.device) for key, value in torch.load(window_file).items()}
