#!/usr/bin/env bash
# Wait (at most $2 seconds) for the marker file $1 (or a failure marker), then pack what exists into $OUT.
S=/root/stage
for i in $(seq "$2"); do
  if [ -f "$S/$1" ] || [ -f $S/regen.failed ]; then break; fi
  sleep 1
done
cd /root/work
tail -c 6000 $S/pipeline.log; for f in $S/calib-*.log $S/train-*.log; do [ -f $f ] && { echo "--- $f"; tail -c 1500 $f; }; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
shift 2
tar cf - "$@" $S/pipeline.log $S/*.log 2>/dev/null | split -b 15M - $OUT/part_
ls -la $OUT
