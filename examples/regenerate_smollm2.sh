#!/usr/bin/env bash
# Data stage of the at-scale SmolLM2 drafter: SmolLM2-135M-Instruct answers the training prompt mix itself (greedy,
# fp32), then the token ids are packed into the committed files under data/smollm2-regen/ (docs/training.md, "Data").
#
# Resumable at any point: rerun the script and it continues where it stopped. Regeneration skips the prompts already
# answered, in runs/regen/ (an uncommitted cache; a line cut by an interruption is repaired) or in the committed
# packed files (--done), so a fresh checkout continues the committed data too; packing merges both and is redone
# after every run, so the committed files can be refreshed after every stage. The held-out slice comes first (small),
# then the training prompts in the mix's balanced order: wherever a stage stops, what is done is a prefix of the mix.
#
# Knobs (environment variables):
#   TRAIN_PROMPTS    training prompts of the mix to answer (default: all 35,689; any prefix is balanced)
#   HELDOUT_PROMPTS  held-out prompts to answer (default 256)
#   STAGE_MINUTES    stop the training regeneration after this many minutes, pack, and exit (rerun to continue)
#   BATCH_SIZE       prompts per generate() call (default 96); THREADS (default 2)
#
# Timings of every run are appended to runs/regen/{heldout,train}.log.jsonl; the recipe is in *.recipe.json.
set -euo pipefail
cd "$(dirname "$0")/.."

REGEN=runs/regen           # jsonl records, recipes and timing logs: an uncommitted cache
DATA=data/smollm2-regen    # committed: the packed token ids and their recipe
HELDOUT_PROMPTS=${HELDOUT_PROMPTS:-256}
BATCH_SIZE=${BATCH_SIZE:-96}
THREADS=${THREADS:-2}

# fp32: bf16 is slower on this CPU and changes the greedy answers (examples/regen_dtype_check.py). Prompts are sorted
# by length within windows of 32 batches (little padding) taken in mix order (balanced prefixes).
COMMON=(--target smollm2 --prompts mix --dtype float32 --batch-size "$BATCH_SIZE" --sort-window $((32 * BATCH_SIZE))
        --max-new-tokens 256 --max-prompt-tokens 384 --threads "$THREADS")
existing() { for file in "$@"; do if [ -f "$file" ]; then echo "$file"; fi; done; }

for split in heldout train; do
  packed=$DATA/$([ $split = train ] && echo ids || echo heldout_ids).safetensors
  if [ $split = train ]; then
    extra=(${TRAIN_PROMPTS:+--limit "$TRAIN_PROMPTS"} ${STAGE_MINUTES:+--stop-after-minutes "$STAGE_MINUTES"})
  else
    extra=(--limit "$HELDOUT_PROMPTS")
  fi
  # shellcheck disable=SC2046  # `existing` prints nothing when the committed file is not there yet
  hf-domino regenerate "${COMMON[@]}" --split $split "${extra[@]}" --done $(existing "$packed") \
    --output $REGEN/$split.jsonl
  hf-domino pack --data $(existing "$packed") $REGEN/$split.jsonl --output "$packed"
done
