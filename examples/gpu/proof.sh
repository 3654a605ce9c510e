#!/usr/bin/env bash
# Issue 22, Part A on the device, stage by stage (`proof.sh [stage ...]`, all by default): each stage's output goes to
# $S/results/<stage>.log (bench tables in $S/results/<stage>/), its exit status to proof.log, and $S/<stage>.done
# marks it finished. Sizes can be shrunk to check the script on a CPU (docs/fast_path.md):
#   S=/tmp/stage W=$PWD PROMPTS=1 TOKENS=8 REPEATS=1 COST_SHAPE=tiny METHODS=target,domino_vocab_k16@eager \
#     bash examples/gpu/proof.sh costs bf16
set -uo pipefail
S=${S:-/root/stage}
source "$(dirname "$0")/env.sh"
R=$S/results; mkdir -p $R
exec >> $R/proof.log 2>&1
cd $W
PROMPTS=${PROMPTS:-10}; TOKENS=${TOKENS:-128}; REPEATS=${REPEATS:-3}; COST_SHAPE=${COST_SHAPE:-qwen3-8b}
MICRO_REPS=${MICRO_REPS:-100}; PYTEST_ARGS=${PYTEST_ARGS:--n 8 --timeout 300}  # xdist, pytest-timeout: on the image
VOCAB=src/hf_domino/checkpoints/smollm2-135m-instruct-domino/draft_vocab.safetensors
METHODS=${METHODS:-target,prompt_lookup,manual,dflash_vocab_k16,domino_vocab_k16@eager,domino_vocab_k16@triton+graph,domino_vocab,domino_vocab_copies,domino_vocab_lookup,domino}
# fp32 runs last and proves identity more than speed: fewer methods, so that it fits what device time is left.
FP32_METHODS=${FP32_METHODS:-target,domino_vocab_k16@eager,domino_vocab_k16@triton+graph,domino_vocab,domino_vocab_lookup}

STAGE_LIMIT=${STAGE_LIMIT:-900}  # seconds: a hung stage must not take the whole lease
export S W R PROMPTS TOKENS REPEATS MICRO_REPS VOCAB  # for the stage functions, which run under `timeout`

stage() {  # stage NAME COMMAND...
  local name=$1 status; shift
  echo "=== $(date +%T) $name: $*"
  timeout $STAGE_LIMIT bash -c "$(declare -f micro bench batch); $(printf '%q ' "$@")" > $R/$name.log 2>&1
  status=$?
  echo "=== $(date +%T) $name: exit $status (124: stopped after ${STAGE_LIMIT} s)"
  touch $S/$name.done
}

micro() {  # 2. the head alone: Qwen3-8B shapes, the shipped drafter's with and without its draft vocabulary
  for temperature in "" "--temperature 1.0"; do
    python3 examples/head_microbench.py --reps $MICRO_REPS $temperature
    python3 examples/head_microbench.py --reps $MICRO_REPS --shapes smollm2-135m $temperature
    python3 examples/head_microbench.py --reps $MICRO_REPS --shapes smollm2-135m --draft-vocab $VOCAB $temperature
  done
}

wait_for_gguf() {  # on the device the SmolLM2 GGUF arrives in parts, one per call (proof_receive.sh)
  for _ in $(seq 1800); do
    python3 -c "from hf_domino.assets import smollm2_gguf_path; smollm2_gguf_path()" 2>/dev/null && return 0
    sleep 1
  done
  echo "no GGUF after 30 minutes"; return 1
}

bench() {  # bench DTYPE METHODS: 3. end to end, both prompt sets
  for prompts in mtbench humaneval; do
    hf-domino bench --target smollm2 --prompts $prompts --num-prompts $PROMPTS --max-new-tokens $TOKENS \
      --temperature 0 --threads 8 --seed 0 --no-progress --dtype $1 --methods $2 \
      --output-dir $R/$1-$prompts
  done
}

batch() {  # issue 20 on the GPU: batches against the batched target alone; _lookup_all: is RETRIEVAL_MAX_ROWS = 2 right?
  hf-domino bench --target smollm2 --prompts mtbench --num-prompts 8 --max-new-tokens $TOKENS --temperature 0 \
    --threads 8 --seed 0 --no-progress --dtype bfloat16 --batch-size 1,2,4,8 --repeats $REPEATS \
    --batch-methods target,domino,domino_copies,domino_lookup,domino_lookup_all,domino_lookup_makespan --output-dir $R/batch-mtbench
}

python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__,
'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
for name in ${@:-micro costs suite bf16 batch fp32}; do
  case $name in
    micro) stage micro micro ;;
    costs) stage costs python3 examples/gpu/cycle_costs.py --shape $COST_SHAPE --dtype bfloat16 ;;
    suite) wait_for_gguf && stage suite python3 -m pytest -q -rs -p no:cacheprovider $PYTEST_ARGS ;;
    bf16) wait_for_gguf && stage bf16 bench bfloat16 $METHODS ;;
    fp32) wait_for_gguf && stage fp32 bench float32 $FP32_METHODS ;;
    batch) wait_for_gguf && stage batch batch ;;
    *) echo "unknown stage $name" ;;
  esac
done
echo "=== $(date +%T) all done"
touch $S/proof.done
