#!/usr/bin/env bash
# One H200: `fasttrain train` of two presets of one workload on the same source, runs new, old,
# old, new (NEW_PRESET, OLD_PRESET). Both compile once side by side first, so the four measured
# runs start from warm Inductor caches. The rows land in $OUT/train-WORKLOAD.jsonl.
#   WORKLOAD=sd OLD_PRESET=benchmarks/results/presets/sd-base-layernorm.toml \
#     NEW_PRESET=benchmarks/results/presets/sd-base-conv.toml bash benchmarks/h200_preset_ab.sh
LANE_BUDGET=${LANE_BUDGET:-585}
. "$(dirname "$0")/lanes.sh"
W=${WORKLOAD:-sd}
PO=${OLD_PRESET:?OLD_PRESET: the preset measured against}
PN=${NEW_PRESET:?NEW_PRESET: the preset measured}
WARM="python3 -m fasttrain train $W --size base --steps 2 --warmup 1 --recipe"
( export FASTTRAIN_CACHE=/tmp/ftcache0
  timeout 330 $WARM "$PO" > "$OUT/warm-old.out" 2>&1 &
  timeout 330 $WARM "$PN" > "$OUT/warm-new.out" 2>&1 &
  wait )
echo "compiled after $(( $(date +%s) - LANE_END + LANE_BUDGET )) s"
lane 0 0-15 "$TRAIN_CMD $W --recipe $PN > $OUT/run-0-$W.out" \
  "$TRAIN_CMD $W --recipe $PO > $OUT/run-1-$W.out" \
  "$TRAIN_CMD $W --recipe $PO > $OUT/run-2-$W.out" \
  "$TRAIN_CMD $W --recipe $PN > $OUT/run-3-$W.out"
finish_lanes
grep '^==' "$OUT/lanes.log"
python3 benchmarks/train_rows.py "$OUT"
