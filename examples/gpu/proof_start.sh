#!/usr/bin/env bash
# Device, first call of the proof (issue 22, Part A; docs/fast_path.md): stage the payload, install the pinned
# wheels, copy this repository to /root/work, file the GGUF's first part, launch proof.sh in its own session (it
# outlives the call while the machine stays warm). Run from the repository root with .gpu/p1 carried.
set -euo pipefail
S=${S:-/root/stage}; W=${W:-/root/work}
mkdir -p $S/bin $S/results
cp -r .gpu/p1/. $S/
tar xf $S/pkgs.tar -C $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $S/whl/*.whl
printf '#!/bin/sh\nexec python3 -m hf_domino.cli "$@"\n' > $S/bin/hf-domino; chmod +x $S/bin/hf-domino
rm -rf $W; mkdir -p $W
tar cf - --exclude=./.gpu --exclude=./.git . | tar xf - -C $W
bash $S/proof_receive.sh
nvidia-smi -L || echo "no nvidia-smi"
setsid nohup bash $S/proof.sh "$@" > /dev/null 2>&1 < /dev/null &
echo launched
