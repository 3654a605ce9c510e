#!/usr/bin/env bash
# On the device: identity check, regeneration stage, pack, calibrate, train CE and KL side by side, export.
set -uo pipefail
S=${S:-/root/stage}
source $S/env.sh
exec >> $S/pipeline.log 2>&1
cd $W
REGEN_MIN=${REGEN_MIN:-6}; CHECK_LIMIT=${CHECK_LIMIT:-191}; TRAIN_SECONDS=${TRAIN_SECONDS:-600}
REGEN_BATCH=${REGEN_BATCH:-512}; HELDOUT=${HELDOUT:-400}; CALIB_STEPS=${CALIB_STEPS:-30}
stamp() { echo "=== $(date +%T) $*"; }
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"

stamp check
hf-domino regenerate --target smollm2 --prompts mix --split train --limit $CHECK_LIMIT --dtype float32 \
  --batch-size $REGEN_BATCH --max-new-tokens 256 --max-prompt-tokens 384 --output runs/check/train.jsonl --no-progress
stamp regen
if HELDOUT_PROMPTS=$HELDOUT BATCH_SIZE=$REGEN_BATCH THREADS=8 STAGE_MINUTES=$REGEN_MIN examples/regenerate_smollm2.sh; then
  touch $S/regen.done
else
  touch $S/regen.failed; exit 1
fi
python3 -c "from hf_domino.training import packed_info as p; print(p('data/smollm2-regen/ids.safetensors')['counts'])"

stamp calibrate
for run in ce kl; do
  KL_WEIGHT=$([ $run = kl ] && echo 1.0 || echo 0.0) OUTPUT=/root/calib-$run TOTAL_STEPS=$CALIB_STEPS SAVE_EVERY=100000 \
    THREADS=4 examples/train_smollm2.sh --overwrite-output-dir --log-every 10 > $S/calib-$run.log 2>&1 &
done
wait
per_step=$(seconds_per_step /root/calib-ce/log.jsonl /root/calib-kl/log.jsonl)
steps=$(python3 -c "print(int($TRAIN_SECONDS / $per_step) // 20 * 20)")
echo "per step ${per_step}s -> $steps steps"; echo $steps > $S/steps
stamp train
for run in ce kl; do
  KL_WEIGHT=$([ $run = kl ] && echo 1.0 || echo 0.0) OUTPUT=runs/train-$run TOTAL_STEPS=$steps \
    SAVE_EVERY=$(( steps / 4 )) THREADS=4 examples/train_smollm2.sh > $S/train-$run.log 2>&1 &
done
wait
stamp export
for run in ce kl; do
  hf-domino export runs/train-$run/final runs/ship-$run --base-model HuggingFaceTB/SmolLM2-135M-Instruct \
    --dtype float16 --overwrite > $S/export-$run.log 2>&1
done
stamp done
touch $S/train.done
