"""Training curves of the shipped SmolLM2 drafter: teacher-forced tau~ and losses over its three stages.

Read the logs under docs/runs/smollm2-at-scale/ (stage 1 with and without distillation, then stages 2 and 3
continuing the label-only run) and wrote docs/img/smollm2_scale_curves.png. Those logs were never committed and are
lost (docs/training.md, "Lost: the stages' logs"); the image stays, and this script draws it again from logs put
back in that folder:

    python examples/plot_smollm2_curves.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hf_domino.training import read_log  # noqa: E402

RUNS = Path("docs/runs/smollm2-at-scale")
CHAIN = ("stage1-ce", "stage2-ce", "stage3-ce")  # each stage starts from the last one's final weights


def smoothed(values: list[float], window: int = 10) -> list[float]:
    """Trailing mean over `window` log records (each record is already a mean over 20 steps)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]


def stage_curves(name: str, offset: int) -> tuple[dict[str, list], dict[str, list], int]:
    train, held_out = read_log(RUNS / name / "log.jsonl"), read_log(RUNS / name / "validation.jsonl")
    steps = [offset + r["step"] for r in train]
    return (
        {"step": steps, **{key: [r[key] for r in train] for key in ("train_tau", "base_loss", "final_loss")}},
        {"step": [offset + r["step"] for r in held_out], "train_tau": [r["train_tau"] for r in held_out]},
        steps[-1],
    )


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not RUNS.is_dir():
        raise SystemExit(
            f'{RUNS} is missing: its logs were never committed (docs/training.md, "Lost: the stages\' logs").'
        )
    figure, (tau_axis, loss_axis) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=120)
    offset = 0
    for index, name in enumerate(CHAIN):
        train, held_out, offset = stage_curves(name, offset)
        label = "labels (CE)" if index == 0 else None
        tau_axis.plot(train["step"], smoothed(train["train_tau"]), color="tab:blue", alpha=0.6, label=label and
                      "training batches, labels (CE)")  # fmt: skip
        tau_axis.plot(held_out["step"], held_out["train_tau"], "o-", color="tab:blue", label=label and
                      "held-out slice, labels (CE)")  # fmt: skip
        loss_axis.plot(train["step"], smoothed(train["final_loss"]), color="tab:blue", label=label and "final (head)")
        loss_axis.plot(train["step"], smoothed(train["base_loss"]), color="tab:blue", ls="--", label=label and "base")
        tau_axis.axvline(offset, color="grey", lw=0.5)
    train, held_out, _ = stage_curves("stage1-kl", 0)
    tau_axis.plot(train["step"], smoothed(train["train_tau"]), color="tab:orange", alpha=0.6,
                  label="training batches, distillation (KL)")  # fmt: skip
    tau_axis.plot(held_out["step"], held_out["train_tau"], "s-", color="tab:orange", label="held-out slice, KL")
    tau_axis.set(xlabel="optimizer step (stages 1, 2, 3)", ylabel="teacher-forced tau~", title="acceptance")
    loss_axis.set(xlabel="optimizer step (stages 1, 2, 3)", ylabel="training loss (CE run)", yscale="log",
                  title="losses")  # fmt: skip
    for axis in (tau_axis, loss_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    output = Path("docs/img/smollm2_scale_curves.png")
    figure.savefig(output)
    print(f"Wrote {output}")


if __name__ == "__main__":
    main()
