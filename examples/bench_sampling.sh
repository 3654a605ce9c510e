#!/usr/bin/env bash
# MT-Bench with sampling at temperature 1 (lossless speculative sampling); `manual` is greedy only and is skipped.
# Outputs differ from the target's by construction here, so no mismatch count is reported.
set -euo pipefail

NUM_PROMPTS="${NUM_PROMPTS:-20}"
THREADS="${THREADS:-2}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/bench/mtbench-T1}"

python -m hf_domino bench \
  --target smollm2 \
  --prompts mtbench \
  --num-prompts "$NUM_PROMPTS" \
  --max-new-tokens 128 \
  --temperature 1 \
  --threads "$THREADS" \
  --methods target,prompt_lookup,dflash,domino \
  --output-dir "$OUTPUT_DIR"
