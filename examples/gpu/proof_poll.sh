#!/usr/bin/env bash
# Device: wait (at most $2 seconds) for the marker $S/$1 (a stage's NAME.done, or proof.done), then bring every
# stage's log and tables back as $OUT/results.tgz.
S=${S:-/root/stage}
for _ in $(seq "$2"); do [ -f "$S/$1" ] && break; sleep 1; done
tail -c 9000 $S/results/proof.log
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
tar czf ${OUT:-/tmp}/results.tgz -C $S results
