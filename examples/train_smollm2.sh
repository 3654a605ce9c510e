#!/usr/bin/env bash
# Reproduces the shipped SmolLM2-135M-Instruct Domino drafter on a CPU machine: regenerate -> features -> train
# (curriculum run + the no-curriculum ablation, side by side) -> evaluate -> export.
#
# Every stage is resumable: rerun the script after an interruption (or with a larger STAGE_MINUTES budget) and it
# picks up where it stopped. See docs/training.md for the numbers this produced and what they mean.
#
# Knobs (environment variables):
#   NUM_PROMPTS    ShareGPT prompts to regenerate answers for        (default 6000; training uses what is there)
#   MAX_EXAMPLES   examples used for training, pinned for both runs  (default: all regenerated so far)
#   TOTAL_STEPS    optimizer steps of each run                       (default 500)
#   STAGE_MINUTES  wall-clock budget of one training stage           (default: none, train to the end)
#   THREADS        torch threads per training process                (default 1: the two runs share 2 cores)
#
# The shipped drafter was trained while regeneration was still running (records 1-128 with --batch-size 32
# --max-new-tokens 256, later ones with the settings below), in two stages of the same two runs:
#   SKIP_REGENERATE=1 MAX_EXAMPLES=128 examples/train_smollm2.sh   # stopped by hand after checkpoint-275
#   SKIP_REGENERATE=1 MAX_EXAMPLES=320 examples/train_smollm2.sh   # resumes at step 275, runs to 650, evaluates, exports
set -euo pipefail
cd "$(dirname "$0")/.."

RUN=runs/smollm2
DATA=$RUN/regen_sharegpt.jsonl
NUM_PROMPTS=${NUM_PROMPTS:-6000}
TOTAL_STEPS=${TOTAL_STEPS:-650}
THREADS=${THREADS:-1}
STAGE=${STAGE_MINUTES:+--stop-after-minutes $STAGE_MINUTES}
mkdir -p $RUN

# 1. The target answers the training prompts itself (greedy, resumable). MT-Bench and HumanEval stay held out.
if [ "${SKIP_REGENERATE:-0}" != 1 ]; then
  hf-domino regenerate --target smollm2 --prompts sharegpt --limit "$NUM_PROMPTS" --batch-size 96 \
    --max-new-tokens 192 --max-prompt-tokens 256 --threads 2 --output $DATA
fi
MAX_EXAMPLES=${MAX_EXAMPLES:-$(wc -l < $DATA)}

# The drafter: 2 draft layers with the target's attention shape, context from target layers 1/14/27, Domino head
# with GRU 256 and rank 64, blocks of 16 with shift_label (16 drafts per block). 11.9M parameters, 23.8 MB in fp16.
ARCH="--num-draft-layers 2 --target-layer-ids 1 14 27 --block-size 16 --gru-hidden-dim 256 --emb-dim 64
      --pure-draft-prefix-len 1"
COMMON="--data $DATA --max-examples $MAX_EXAMPLES --max-length 512 --feature-cache $RUN/features $ARCH
        --total-steps $TOTAL_STEPS --num-anchors 32 --batch-size 1 --lr 6e-4 --log-every 10 --save-every 25"

# 2. Target features, once for both runs (the target forward costs about as much as a drafter step on CPU).
hf-domino train $COMMON --features-only --threads 2

# 3. Curriculum run and the no-curriculum ablation, concurrently, one thread each.
hf-domino train $COMMON --output-dir $RUN/curriculum --threads "$THREADS" $STAGE &
hf-domino train $COMMON --output-dir $RUN/no_curriculum --no-curriculum --threads "$THREADS" $STAGE &
wait
if [ ! -d $RUN/curriculum/final ] || [ ! -d $RUN/no_curriculum/final ]; then
  echo "Stage done; rerun this script to continue training."; exit 0
fi

# 4. Held-out acceptance lengths at T=0: 20 MT-Bench first turns and 20 HumanEval problems, 128 new tokens, head on
#    and off on the same weights, both runs; four processes side by side.
for run in curriculum no_curriculum; do
  for set in mtbench humaneval; do
    hf-domino train --eval-only --drafter $RUN/$run/final --eval-prompts $set --eval-limit 20 --max-new-tokens 128 \
      --head both --threads 1 --eval-output $RUN/eval_${run}_${set}.json &
  done
done
wait

# 5. Loss curves and the shipped checkpoint (fp16 safetensors + remote code + model card with the results).
python - <<'EOF'
import json
from pathlib import Path

import torch

from hf_domino import DominoForSpeculation
from hf_domino.export import export_drafter
from hf_domino.training import plot_loss_curves

SUMMARY = (
    "Trained with `hf-domino train` (examples/train_smollm2.sh in hf-domino) on ShareGPT prompts answered by "
    "SmolLM2-135M-Instruct itself (320 conversations, 64k response tokens; MT-Bench and HumanEval held out): 650 "
    "AdamW steps of 1 sequence x 32 random blocks of 16, lr 6e-4 cosine (4% warmup), base-anchored curriculum "
    "(lam 1 -> 0), position weights exp(-k/16), about one hour on 2 CPU threads. This is a tiny CPU budget (orders "
    "of magnitude below the paper's): the drafter is a working, lossless demonstration, not a strong drafter."
)
run = Path("runs/smollm2")
plot_loss_curves(
    {"curriculum": run / "curriculum/log.jsonl", "no curriculum (lam = 0)": run / "no_curriculum/log.jsonl"},
    "docs/img/curriculum_base_loss.png",
)
rows = []
for name, label in (("curriculum", "curriculum (shipped)"), ("no_curriculum", "no curriculum")):
    results = {}
    for prompt_set in ("mtbench", "humaneval"):
        results |= json.loads((run / f"eval_{name}_{prompt_set}.json").read_text())
    for key, result in results.items():
        prompts, head = key.split("/")
        rows.append(
            {
                "training": label,
                "prompts (held out)": {"mtbench": "MT-Bench turn 1", "humaneval": "HumanEval"}.get(prompts, prompts),
                "Domino head": head.removeprefix("head_"),
                "acceptance length (T=0, 20 prompts, 128 tokens)": f"{result['mean_acceptance_length']:.3f}",
            }
        )
drafter = DominoForSpeculation.from_pretrained(run / "curriculum/final")
export_drafter(
    drafter,
    "src/hf_domino/checkpoints/smollm2-135m-instruct-domino",
    base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
    results=rows,
    training_summary=SUMMARY,
    dtype=torch.float16,
    overwrite=True,
)
EOF
