#!/usr/bin/env bash
# Benchmarks of SmolLM2-135M-Instruct on CPU, every method interleaved per prompt in one process, as in
# docs/benchmarks.md. Writes bench.json, bench.md and bench_*.png per run under runs/bench/.
# Run it on an otherwise idle machine: the numbers are wall-clock times.
#
#   examples/bench_smollm2.sh                        # draft policies, shipped and untrained drafter, both prompt sets
#   PROMPTS=mtbench DRAFTERS=shipped examples/bench_smollm2.sh
#   TEMPERATURE=1 METHODS=target,prompt_lookup,domino,domino_k4 examples/bench_smollm2.sh
set -euo pipefail

PROMPTS="${PROMPTS:-mtbench humaneval}"
DRAFTERS="${DRAFTERS:-shipped untrained}"
NUM_PROMPTS="${NUM_PROMPTS:-6}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-96}"
TEMPERATURE="${TEMPERATURE:-0}"
THREADS="${THREADS:-2}"
METHODS="${METHODS:-target,prompt_lookup,domino_k16,domino_k8,domino_k4,domino_k2,domino,domino_vocab}"

# The shipped drafter carries its draft vocabulary (`domino_vocab` uses it, `domino` does not); DRAFTER=<folder> benches
# another one.
DRAFTER="${DRAFTER:-src/hf_domino/checkpoints/smollm2-135m-instruct-domino}"

for prompts in $PROMPTS; do
  for drafter in $DRAFTERS; do
    extra=()
    [ "$drafter" = untrained ] && extra=(--random-weights)
    python -m hf_domino bench \
      --target smollm2 \
      --drafter "$DRAFTER" "${extra[@]}" \
      --prompts "$prompts" \
      --num-prompts "$NUM_PROMPTS" \
      --max-new-tokens "$MAX_NEW_TOKENS" \
      --temperature "$TEMPERATURE" \
      --threads "$THREADS" \
      --methods "$METHODS" \
      --no-progress \
      --output-dir "runs/bench/${prompts}-${drafter}-T${TEMPERATURE}"
  done
done
