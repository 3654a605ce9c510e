#!/usr/bin/env bash
# Issue 22, Part A, stage by stage: `proof.sh STAGE ...` runs the named stages in order (docs/fast_path.md, "Proving it
# on a lent GPU"; on the device `proof_call.sh` calls it). Each stage's output goes to $S/results/<stage>.log (bench
# tables to $S/results/<stage>-<prompts>/), its exit status to $S/results/proof.log. Each runs under `timeout`: its own
# limit, and never past $DEADLINE (epoch seconds), so that a call ends with its results inside the device's time; a
# stage with under 20 s left is skipped. Sizes can be shrunk to check the script on a CPU:
#   S=/tmp/stage W=$PWD PROMPTS=1 TOKENS=8 COST_SHAPE=tiny MICRO_REPS=2 METHODS=target,domino_vocab_k16@eager \
#     BATCH_PROMPTS=2 BATCH_SIZES=1,2 bash examples/gpu/proof.sh costs bf16 batch
set -uo pipefail
S=${S:-/root/stage}
source "$(dirname "$0")/env.sh"
R=$S/results; mkdir -p $R
cd $W
DEADLINE=${DEADLINE:-$(( $(date +%s) + 86400 ))}
PROMPTS=${PROMPTS:-10}; TOKENS=${TOKENS:-128}; COST_SHAPE=${COST_SHAPE:-qwen3-8b}; MICRO_REPS=${MICRO_REPS:-100}
BATCH_PROMPTS=${BATCH_PROMPTS:-8}; BATCH_SIZES=${BATCH_SIZES:-1,2,4,8}; PYTEST_WORKERS=${PYTEST_WORKERS:-14}  # xdist and pytest-timeout: on the image
VOCAB=src/hf_domino/checkpoints/smollm2-135m-instruct-domino/draft_vocab.safetensors
# bf16 is the speed claim: the target alone, prompt lookup, DFlash and Domino with whole blocks (head eager and fused),
# and the default (adaptive, draft vocabulary, copies and retrieval). fp32 proves identity: fewer methods.
METHODS=${METHODS:-target,prompt_lookup,dflash_vocab_k16,domino_vocab_k16@eager,domino_vocab_k16@triton+graph,domino_vocab_lookup}
FP32_METHODS=${FP32_METHODS:-target,domino_vocab_k16@triton+graph,domino_vocab_lookup}
# issue 20 on a GPU: is RETRIEVAL_MAX_ROWS = 2 right there (_lookup_all), and should PRICE_BY_MAKESPAN be the default?
BATCH_METHODS=${BATCH_METHODS:-target,domino_lookup,domino_lookup_all,domino_lookup_makespan}
export S W R PROMPTS TOKENS MICRO_REPS VOCAB BATCH_PROMPTS BATCH_SIZES  # for the stage functions, which run under `timeout`

stage() {  # stage NAME LIMIT COMMAND...
  local name=$1 limit=$2 left status; shift 2
  left=$(( DEADLINE - $(date +%s) ))
  if [ $left -lt 20 ]; then
    echo "=== $(date +%T) $name: skipped, ${left} s left before the deadline" | tee -a $R/proof.log; return
  fi
  [ $left -lt $limit ] && limit=$left
  echo "=== $(date +%T) $name (at most $limit s): $*" | tee -a $R/proof.log
  timeout $limit bash -c "$(declare -f micro bench batch); $(printf '%q ' "$@")" > $R/$name.log 2>&1
  status=$?
  echo "=== $(date +%T) $name: exit $status (124: stopped after $limit s)" | tee -a $R/proof.log
}

micro() {  # the head alone: Qwen3-8B shapes, the shipped drafter's without and with its draft vocabulary
  for temperature in "" "--temperature 1.0"; do
    python3 examples/head_microbench.py --reps $MICRO_REPS $temperature
    python3 examples/head_microbench.py --reps $MICRO_REPS --shapes smollm2-135m $temperature
    python3 examples/head_microbench.py --reps $MICRO_REPS --shapes smollm2-135m --draft-vocab $VOCAB $temperature
  done
}

bench() {  # bench DTYPE METHODS: end to end with the SmolLM2 target and the shipped drafter, both prompt sets
  for prompts in mtbench humaneval; do
    hf-domino bench --target smollm2 --prompts $prompts --num-prompts $PROMPTS --max-new-tokens $TOKENS \
      --temperature 0 --threads 8 --seed 0 --no-progress --dtype $1 --methods $2 --output-dir $R/$1-$prompts
  done
}

batch() {  # batches against the batched target alone, bf16
  hf-domino bench --target smollm2 --prompts mtbench --num-prompts $BATCH_PROMPTS --max-new-tokens $TOKENS \
    --temperature 0 --threads 8 --seed 0 --no-progress --dtype bfloat16 --batch-size $BATCH_SIZES \
    --batch-methods $1 --output-dir $R/batch-mtbench
}

# One hung test must not take the stage (pytest-timeout is on the image; not necessarily where the script is checked).
TEST_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__,
'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee -a $R/proof.log
for name in "$@"; do
  case $name in
    cuda) stage cuda 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_triton_head.py tests/test_cpu_fast_path.py -k cuda ;;
    micro) stage micro 90 micro ;;
    costs) stage costs 120 python3 examples/gpu/cycle_costs.py --shape $COST_SHAPE --dtype bfloat16 ;;
    bf16) stage bf16 300 bench bfloat16 $METHODS ;;
    fp32) stage fp32 120 bench float32 $FP32_METHODS ;;
    batch) stage batch 120 batch $BATCH_METHODS ;;
    suite) stage suite 600 python3 -m pytest -v -rs -p no:cacheprovider -n $PYTEST_WORKERS $TEST_TIMEOUT ;;
    *) echo "unknown stage $name" | tee -a $R/proof.log ;;
  esac
done
