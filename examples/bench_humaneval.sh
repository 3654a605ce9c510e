#!/usr/bin/env bash
# Greedy HumanEval benchmark (code completion prompts), same methods and settings as bench_mtbench.sh.
set -euo pipefail

NUM_PROMPTS="${NUM_PROMPTS:-20}"
THREADS="${THREADS:-2}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/bench/humaneval-T0}"

python -m hf_domino bench \
  --target smollm2 \
  --prompts humaneval \
  --num-prompts "$NUM_PROMPTS" \
  --max-new-tokens 128 \
  --temperature 0 \
  --threads "$THREADS" \
  --methods target,prompt_lookup,dflash,domino,manual \
  --output-dir "$OUTPUT_DIR"
