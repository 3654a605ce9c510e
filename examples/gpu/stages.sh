#!/usr/bin/env bash
# The device's work, stage by stage: `stages.sh STAGE ...` runs the named stages in order (issue 22: Part A's proof,
# docs/fast_path.md, "Proving it on a lent GPU"; Part B's `finetune`, docs/training.md, "A training stage in 15 minutes
# of device time"; on the device `call.sh` calls it). Each stage's output goes to $S/results/<stage>.log (bench
# tables to $S/results/<stage>-<prompts>/), its exit status to $S/results/stages.log. Each runs under `timeout`: its own
# limit, and never past $DEADLINE (epoch seconds), so that a call ends with its results inside the device's time; a
# stage with under $MIN_STAGE_SECONDS (20) s left is skipped. Sizes can be shrunk to check the script on a CPU:
#   S=/tmp/stage W=$PWD PROMPTS=1 TOKENS=8 COST_SHAPE=tiny SMALL_COST_SHAPE=tiny STALL_SHAPE=tiny MICRO_REPS=2 METHODS=target,domino_vocab_k16@eager \
#     BATCH_PROMPTS=2 BATCH_TOKENS=8 BATCH_SIZES=1,2 LAPS_DTYPES=float32 LAPS_ARGS="--new-tokens 4 --warmup-tokens 2 --rounds 1" \
#     SERVE_ARGS="--num-prompts 2 --rows 2 --max-new-tokens 8" bash examples/gpu/stages.sh costs bf16 batch laps serve
set -uo pipefail
S=${S:-/root/stage}
source "$(dirname "$0")/env.sh"
R=$S/results; mkdir -p $R
cd $W
DEADLINE=${DEADLINE:-$(( $(date +%s) + 86400 ))}
MIN_STAGE_SECONDS=${MIN_STAGE_SECONDS:-20}  # less only to check the script quickly on a CPU
PROMPTS=${PROMPTS:-4}; TOKENS=${TOKENS:-128}; COST_SHAPE=${COST_SHAPE:-qwen3-8b}; MICRO_REPS=${MICRO_REPS:-100}
STALL_SHAPE=${STALL_SHAPE:-smollm2-135m}
# costs at the end-to-end benches' sizes too (random weights, no profile), where the host sets a cycle's time on a GPU;
# empty: none (a CPU check)
SMALL_COST_SHAPE=${SMALL_COST_SHAPE-smollm2-135m}
# the bf16 slow state, cuDNN's attention left out and allowed (lap_probe.py); LAPS_ARGS adds options (smaller calls
# to check it on a CPU)
LAPS_DTYPES=${LAPS_DTYPES:-bfloat16}; LAPS_ARGS=${LAPS_ARGS:-}
BATCH_PROMPTS=${BATCH_PROMPTS:-8}; BATCH_TOKENS=${BATCH_TOKENS:-64}; BATCH_SIZES=${BATCH_SIZES:-1,2,4,8}
# requests joining as rows finish (`generate_batch`, examples/serve_requests.py), fp32 on the GPU; SERVE_ARGS shrinks it
SERVE_ARGS=${SERVE_ARGS:---prompts humaneval --num-prompts 16 --rows 4 --max-new-tokens 64 --repeats 1}
PYTEST_WORKERS=${PYTEST_WORKERS:-14}  # xdist and pytest-timeout: on the image
VOCAB=src/hf_domino/checkpoints/smollm2-135m-instruct-domino/draft_vocab.safetensors
# bf16 is the speed claim: the target alone, Domino (head fused) with whole blocks, and the default (adaptive, draft
# vocabulary, copies and retrieval); the eager head is `micro`'s. fp32 proves identity. The first run (2026-11-26) ran
# out of its 300 s with six methods x 10 prompts; the second measured prompt lookup and DFlash too (5 methods x 6
# MT-Bench prompts in 258 s, HumanEval's first prompt only): 3 methods x 4 prompts per set, and since the drafter's
# calls leave cuDNN's attention out in half precision, the target alone that way too (`target_no_cudnn`). fp32 also
# runs a tree of four first-token branches of four drafts (`domino_branches`, the head fused: the 17 tokens whole
# blocks verify, spent on branches; docs/usage.md, "First-token branches"), there and not in bf16 so that a first run of it
# on CUDA cannot cost the bf16 stage its records.
METHODS=${METHODS:-target,target_no_cudnn,domino_vocab_k16@triton+graph,domino_vocab_lookup}
FP32_METHODS=${FP32_METHODS:-target,domino_vocab_k16@triton+graph,domino_vocab_lookup,domino_vocab_lookup_tree4}
# A static cache, where transformers compiles the target's forward (CUDA graphs) for the target alone and for the
# loop verifying the drafts alike: what a GPU user who compiles gets (transformers 5.24; docs/usage.md).
STATIC_METHODS=${STATIC_METHODS:-target,domino_vocab_lookup,domino_vocab_k16@triton+graph}
# issue 20 on a GPU: the default (the head fused for all rows, with a CUDA graph) against the batched target alone,
# at 1, 2, 4 and 8 rows (the goal: 2-4 keep batch 1's speedup). The second run's stage (also `domino_lookup@eager` and
# `domino_lookup_makespan`, 8 prompts x 64 tokens) wrote nothing in its 120 s, in the slow state since traced to
# cuDNN's attention; the third ran 1 and 8 rows in 54 s, in that state too; the fifth, 8 prompts x 32 tokens, the
# target both ways and the default in 79 s: 2-4 rows 1.02-1.07x against 1.23x at one (most cycles of a new batch size
# plain, priced by the batch-1 backbone times the rows; grown as the target's table since). 64 tokens, and a tree of 4
# first-token branches, which a GPU's flat verification should pay for (docs/usage.md, "First-token branches").
BATCH_METHODS=${BATCH_METHODS:-target,domino_lookup,domino_lookup_tree4}
# Part B: continuations of the shipped drafter side by side, anchors drawn uniformly and among generate()'s own blocks;
# the last FINETUNE_RESERVE seconds of the stage are for their final validation and export.
FINETUNE_RUNS=${FINETUNE_RUNS:-uniform chain}; FINETUNE_RESERVE=${FINETUNE_RESERVE:-150}
# for the stage functions, which run under `timeout`
export S W R PROMPTS TOKENS MICRO_REPS VOCAB BATCH_PROMPTS BATCH_TOKENS BATCH_SIZES SERVE_ARGS FINETUNE_RUNS FINETUNE_RESERVE

stage() {  # stage NAME LIMIT COMMAND...
  local name=$1 limit=$2 left status; shift 2
  left=$(( DEADLINE - $(date +%s) ))
  if [ $left -lt $MIN_STAGE_SECONDS ]; then
    echo "=== $(date +%T) $name: skipped, ${left} s left before the deadline" | tee -a $R/stages.log; return
  fi
  [ $left -lt $limit ] && limit=$left
  echo "=== $(date +%T) $name (at most $limit s): $*" | tee -a $R/stages.log
  # SIGINT first: pytest then still prints its failures and summary, python its traceback (where it was). The fourth
  # run's suite (14 workers) was still stopping 10 s after it and lost its failure reports: 20 s.
  STAGE_END=$(( $(date +%s) + limit )) timeout --signal=INT --kill-after=20 $limit bash -c "$(declare -f micro bench batch finetune seconds_per_step); \
    $(printf '%q ' "$@")" > $R/$name.log 2>&1
  status=$?
  echo "=== $(date +%T) $name: exit $status (124: stopped after $limit s)" | tee -a $R/stages.log
}

micro() {  # the head alone: Qwen3-8B shapes, the shipped drafter's without and with its draft vocabulary, a batch
  for temperature in "--temperature 0.6 --top-k 20 --top-p 0.95" "" "--temperature 1.0"; do  # Qwen3's defaults first
    if [ -z "$temperature" ]; then  # 4 rows drafted together, as the batch loop does (greedy only: new, so early)
      python3 examples/head_microbench.py --reps $MICRO_REPS --shapes smollm2-135m --draft-vocab $VOCAB --rows 4
    fi
    python3 examples/head_microbench.py --reps $MICRO_REPS $temperature
    python3 examples/head_microbench.py --reps $MICRO_REPS --shapes smollm2-135m --draft-vocab $VOCAB $temperature
    python3 examples/head_microbench.py --reps $MICRO_REPS --shapes smollm2-135m $temperature
  done
}

bench() {  # bench DTYPE METHODS [PROMPT SETS [EXTRA FLAGS]]: the SmolLM2 target and the shipped drafter, end to end
  for prompts in ${3:-mtbench humaneval}; do
    hf-domino bench --target smollm2 --prompts $prompts --num-prompts $PROMPTS --max-new-tokens $TOKENS \
      --temperature 0 --threads 8 --seed 0 --dtype $1 --methods $2 --output-dir $R/$1${4:+-static}-$prompts ${4:-}
  done
}

batch() {  # batches against the batched target alone, bf16, 64 tokens as the CPU's batch runs
  hf-domino bench --target smollm2 --prompts mtbench --num-prompts $BATCH_PROMPTS --max-new-tokens $BATCH_TOKENS \
    --temperature 0 --threads 8 --seed 0 --dtype bfloat16 --batch-size $BATCH_SIZES \
    --batch-methods $1 --output-dir $R/batch-mtbench
}

# One hung test must not take the stage (pytest-timeout is on the image; not necessarily where the script is checked).
# The fifth run's real-model tests (the README's demo, the shipped drafter on MT-Bench, the docs' Python blocks: each
# loads SmolLM2 beside 13 other workers) passed 120 s: 300.
TEST_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 300")
finetune() {  # each of $FINETUNE_RUNS from the shipped drafter, as many steps as the stage's time allows, exported
  local D=src/hf_domino/checkpoints/smollm2-135m-instruct-domino run steps last
  knobs() { echo "INIT_FROM=$D DRAFT_VOCAB=$D THREADS=4 $([ $1 = chain ] && echo ANCHOR_CHAIN=1)"; }
  for run in $FINETUNE_RUNS; do  # a few steps side by side, as the runs will share the GPU: seconds per step
    env $(knobs $run) OUTPUT=/root/calib-$run TOTAL_STEPS=${CALIB_STEPS:-20} SAVE_EVERY=100000 examples/train_smollm2.sh \
      --data data/smollm2-regen/ids.safetensors --validation-examples 0 --overwrite-output-dir --log-every 1 \
      > $R/calib-$run.log 2>&1 &
  done
  wait
  per_step=$(seconds_per_step /root/calib-*/log.jsonl) || return 1
  for run in $FINETUNE_RUNS; do cp /root/calib-$run/log.jsonl $R/calib-$run.jsonl; done  # each step's time and length
  steps=$(python3 -c "print(max(int(($STAGE_END - $(date +%s) - $FINETUNE_RESERVE) / $per_step), 2))")
  echo "$per_step s per step side by side: $steps steps each"
  for run in $FINETUNE_RUNS; do
    env $(knobs $run) OUTPUT=runs/finetune-$run TOTAL_STEPS=$steps SAVE_EVERY=$steps GENERATE_TAU=1 LR=${LR:-2e-4} \
      WARMUP=0.02 SEED=${SEED:-2} STAGE_MINUTES=$(python3 -c "print(max(($STAGE_END - $(date +%s) - $FINETUNE_RESERVE) / 60, 0.5))") \
      examples/train_smollm2.sh --overwrite-output-dir > $R/train-$run.log 2>&1 &
  done
  wait
  for run in $FINETUNE_RUNS; do  # float16 weights and config (the rest is the shipped drafter's), and the logs
    last=$(ls -d runs/finetune-$run/checkpoint-* | sort -t- -k3 -n | tail -1)
    hf-domino export $last /root/export-$run --base-model HuggingFaceTB/SmolLM2-135M-Instruct --dtype float16 \
      --overwrite > /dev/null
    mkdir -p $R/finetune-$run
    cp /root/export-$run/model.safetensors /root/export-$run/config.json runs/finetune-$run/*.jsonl $R/finetune-$run/
    grep -h "^validation" $R/train-$run.log | sed "s/^/$run: /"
  done
}

python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__,
'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee -a $R/stages.log
for name in "$@"; do
  case $name in
    cuda) stage cuda 150 python3 -m pytest -v -rfEs --tb=short -p no:cacheprovider tests/test_triton_head.py tests/test_cpu_fast_path.py \
      tests/test_on_cuda.py tests/test_training.py -k cuda ;;
    micro) stage micro 90 micro ;;
    laps) stage laps 150 bash -c "for dtype in $LAPS_DTYPES; do python3 examples/gpu/lap_probe.py --dtype \$dtype \
      --new-tokens 48 --rounds 2 $LAPS_ARGS; done" ;;
    stalls) stage stalls 100 bash -c "for threads in 8 1; do python3 examples/gpu/stall_probe.py --shape $STALL_SHAPE \
      --dtype bfloat16 --repeats 5 --threads \$threads; done" ;;
    costs) stage costs 120 bash -c "python3 examples/gpu/cycle_costs.py --shape $COST_SHAPE --dtype bfloat16 --profile 16 \
      && for shape in $SMALL_COST_SHAPE; do python3 examples/gpu/cycle_costs.py --shape \$shape --dtype bfloat16; done" ;;
    bf16) stage bf16 240 bench bfloat16 $METHODS ;;
    static) stage static 180 bench bfloat16 $STATIC_METHODS mtbench --static-cache ;;
    fp32) stage fp32 120 bench float32 $FP32_METHODS ;;
    batch) stage batch 200 batch $BATCH_METHODS ;;
    serve) stage serve 120 python3 examples/serve_requests.py $SERVE_ARGS --threads 8 ;;
    # An offloaded target (docs/usage.md, "Offloaded targets"): 150 MB of SmolLM2 on the GPU, the rest in CPU memory,
    # alone and with the drafter. Not in a call's default stages: STAGES=offload, where time is left.
    offload) stage offload 120 bash -c "for prompts in mtbench humaneval; do python3 examples/offloaded_target.py \
      --prompts \$prompts --num-prompts $PROMPTS --max-new-tokens $TOKENS --threads 8; done" ;;
    # A target with recurrent layers (docs/usage.md, "Targets with recurrent layers"): a Qwen3.5-shaped target's
    # verification costs and what a rejection costs after it, with transformers' reference kernels, then with
    # flash-linear-attention (its wheels from call 1's payload, on the path of this stage only); then a
    # Nemotron-H-shaped one (Mamba2 mixers, reference kernels: mamba-ssm is not in the payload). STAGES=recurrent.
    recurrent) stage recurrent 300 bash -c "python3 examples/recurrent_targets.py --device cuda --dtype bfloat16 \
      --threads 8 && python3 -m pip install -q --no-index --no-deps --target $S/fla-site $S/fla/*.whl && \
      PYTHONPATH=$S/fla-site:\$PYTHONPATH python3 examples/recurrent_targets.py --device cuda --dtype bfloat16 \
      --threads 8 && python3 examples/recurrent_targets.py --family nemotron_h --layers 16 --device cuda \
      --dtype bfloat16 --threads 8" ;;
    finetune) stage finetune 600 finetune ;;
    suite) stage suite 600 env HF_DOMINO_FAILURES_LOG=$R/suite-failures.log \
      python3 -m pytest -v -rfEs --tb=short -p no:cacheprovider -n $PYTEST_WORKERS $TEST_TIMEOUT ;;
    *) echo "unknown stage $name" | tee -a $R/stages.log ;;
  esac
done
