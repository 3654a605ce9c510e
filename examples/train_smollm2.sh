#!/usr/bin/env bash
# Training stage of the at-scale SmolLM2 drafter on the committed regenerated data (data/smollm2-regen/, see
# examples/regenerate_smollm2.sh). docs/training.md ("The drafter at scale") has the stages the shipped drafter ran.
#
# The same command runs on this CPU and on a GPU (bf16 autocast there; on a CPU with AMX,
# ACCELERATE_MIXED_PRECISION=bf16 halves a step, docs/training.md). Resumable: rerun with the same OUTPUT and it
# continues from its latest checkpoint, bit for bit; STAGE_MINUTES checkpoints and stops a stage early. The held-out
# slice of the mix (heldout_ids.safetensors) is the validation set: every checkpoint logs its teacher-forced tau~
# to OUTPUT/validation.jsonl, which is what picks the drafter to ship, not the training loss.
#
# Knobs (environment variables):
#   OUTPUT        run folder (default runs/train-smollm2); the finished drafter is saved to OUTPUT/final
#   INIT_FROM     continue from this drafter folder (a later stage) instead of starting from the target's layers
#   TOTAL_STEPS   optimizer steps (default 2500); the cosine schedule and the curriculum span them
#   LR (6e-4), WARMUP (0.04), SEED (0)
#   KL_WEIGHT     share of the loss that distills the target's next-token distribution (default 0: labels only;
#                 1 measured no better at equal steps, docs/training.md)
#   DRAFT_VOCAB   train and score over this draft vocabulary (a draft_vocab.safetensors file or a drafter folder with
#                 one, e.g. the shipped drafter): the drafter's share of a CPU step is 3.6x cheaper (docs/training.md)
#   LAYERS (2), INTERMEDIATE (1536)  draft layers and their MLP width, for a new drafter (not with INIT_FROM);
#                 in the 25 MB budget: 3 layers at INTERMEDIATE=768 (22.9 MB fp16), 4 at 512 (23.8 MB); an MLP
#                 narrower than the target's starts fresh (only same-shape weights are copied)
#   BATCH_SIZE    sequences per step (default 16); NUM_ANCHORS blocks per sequence (default 32)
#   ANCHOR_CHAIN=1  draw anchors among generate()'s own blocks over each answer, not uniformly (docs/training.md,
#                 "Where blocks start"; 100 steps of it on a CPU gained no more than random anchors, at 3.5x a step);
#                 GENERATE_TAU=1 also logs generate()'s acceptance on the held-out answers
#   SAVE_EVERY    steps between checkpoints and validations (default 500); STAGE_MINUTES; THREADS (default 2)
# Extra arguments go to `hf-domino train` as they are.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=data/smollm2-regen
heldout=$(python3 -c "from hf_domino.training import packed_info
print(packed_info('$DATA/heldout_ids.safetensors')['counts']['examples'])")

# Architecture of the shipped drafter (under 25 MB in fp16): 2 draft layers started from the target's top layers,
# context from target layers 1/14/27, a GRU of 256 over 64-dim token embeddings, blocks of 16 drafts.
if [ -n "${INIT_FROM:-}" ]; then
  start=(--init-from "$INIT_FROM")
else
  start=(--init-from-target --num-draft-layers "${LAYERS:-2}" --intermediate-size "${INTERMEDIATE:-1536}"
         --target-layer-ids 1 14 27 --block-size 16 --pure-draft-prefix-len 1 --emb-dim 64 --gru-hidden-dim 256)
fi

# Sequences are at most 384 prompt + 256 response tokens (the regeneration's limits).
hf-domino train --target smollm2 \
  --data $DATA/ids.safetensors $DATA/heldout_ids.safetensors --validation-examples "$heldout" --max-length 640 \
  "${start[@]}" \
  --total-steps "${TOTAL_STEPS:-2500}" --batch-size "${BATCH_SIZE:-16}" --num-anchors "${NUM_ANCHORS:-32}" \
  --lr "${LR:-6e-4}" --warmup-ratio "${WARMUP:-0.04}" --seed "${SEED:-0}" --kl-weight "${KL_WEIGHT:-0}" \
  --save-every "${SAVE_EVERY:-500}" --log-every 20 --threads "${THREADS:-2}" \
  ${STAGE_MINUTES:+--stop-after-minutes "$STAGE_MINUTES"} ${DRAFT_VOCAB:+--draft-vocab "$DRAFT_VOCAB"} \
  ${ANCHOR_CHAIN:+--anchor-chain} ${GENERATE_TAU:+--generate-tau} \
  --output-dir "${OUTPUT:-runs/train-smollm2}" "$@"
