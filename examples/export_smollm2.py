"""Exports the trained SmolLM2 drafter into the package (fp16 + remote code + model card with the held-out results).

Last step of examples/train_smollm2.sh; reads runs/smollm2/target_init/{final,log.jsonl} and the evaluation JSONs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_domino import DominoForSpeculation
from hf_domino.export import export_drafter
from hf_domino.training import read_log

RUN = Path("runs/smollm2")
SHIPPED = Path("src/hf_domino/checkpoints/smollm2-135m-instruct-domino")
PROMPT_SETS = {"mtbench": "MT-Bench turn 1", "humaneval": "HumanEval"}


def result_rows() -> list[dict[str, str]]:
    rows = []
    for prompt_set, label in PROMPT_SETS.items():
        results = json.loads((RUN / f"eval_target_init_{prompt_set}.json").read_text())
        for key, result in results.items():
            rows.append(
                {
                    "prompts (held out)": label,
                    "Domino head": key.split("/")[1].removeprefix("head_"),
                    "acceptance length (T=0, 20 prompts, 128 tokens)": f"{result['mean_acceptance_length']:.3f}",
                }
            )
    return rows


def training_summary() -> str:
    log = read_log(RUN / "target_init" / "log.jsonl")
    steps, minutes = log[-1]["step"], log[-1]["elapsed_s"] / 60
    return (
        "Trained with `hf-domino train` (examples/train_smollm2.sh in hf-domino) on ShareGPT prompts answered by "
        "SmolLM2-135M-Instruct itself (992 conversations, 179k response tokens; MT-Bench and HumanEval held out): "
        f"{steps} AdamW steps of 1 sequence x 32 random blocks of 16, lr 6e-4 cosine (4% warmup), base-anchored "
        "curriculum (lam 1 -> 0), position weights exp(-k/16), draft layers initialized from the target's layers "
        f"28-29, {minutes:.0f} minutes on 2 CPU threads. This is a tiny CPU budget (orders of magnitude below the "
        "paper's): a working, lossless drafter, not a strong one."
    )


if __name__ == "__main__":
    drafter = DominoForSpeculation.from_pretrained(RUN / "target_init" / "final")
    export_drafter(
        drafter,
        SHIPPED,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        results=result_rows(),
        training_summary=training_summary(),
        dtype=torch.float16,
        overwrite=True,
    )
    print(f"Exported to {SHIPPED}")
