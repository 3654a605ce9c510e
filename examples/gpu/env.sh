S=${S:-/root/stage}
W=${W:-/root/work}
# The caller's PYTHONPATH stays behind ours: the suite runs these scripts inside a stage, whose pinned transformers
# and prompt sources are only there.
export PATH=$S/bin:$PATH PYTHONPATH=$S/site:$S/pkgs:$W/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# A training calibration's speed (pipeline.sh, stages.sh `finetune`): the slowest of the runs' log.jsonl files, in
# seconds per step after the first (warm-up) step.
seconds_per_step() {
  python3 - "$@" <<'PY'
import json, sys
worst = 0.0
for path in sys.argv[1:]:
    records = [json.loads(line) for line in open(path)]
    worst = max(worst, (records[-1]["elapsed_s"] - records[0]["elapsed_s"]) / (records[-1]["step"] - records[0]["step"]))
print(worst)
PY
}
