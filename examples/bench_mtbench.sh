#!/usr/bin/env bash
# Greedy MT-Bench benchmark of SmolLM2-135M-Instruct with the shipped Domino drafter, on CPU, every method
# interleaved per prompt in one process. Writes bench.json, bench.md and bench_*.png to the output folder.
# Run it on an otherwise idle machine: the numbers are wall-clock times.
set -euo pipefail

NUM_PROMPTS="${NUM_PROMPTS:-20}"
THREADS="${THREADS:-2}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/bench/mtbench-T0}"

python -m hf_domino bench \
  --target smollm2 \
  --prompts mtbench \
  --num-prompts "$NUM_PROMPTS" \
  --max-new-tokens 128 \
  --temperature 0 \
  --threads "$THREADS" \
  --methods target,prompt_lookup,dflash,domino,manual \
  --output-dir "$OUTPUT_DIR"
