#!/usr/bin/env bash
# One GPU: single switches on top of a preset, `fasttrain train` runs A B C … C B A (A the
# preset, each later letter the preset with one of SWITCHES set via --set), so a linear drift
# of the machine cancels out of each pair. Every variant compiles once side by side first (two
# steps each), so the measured runs start from warm caches. Rows: $OUT/train-WORKLOAD.jsonl.
#   WORKLOAD=vit PRESET=benchmarks/results/presets/vit-base-stream.toml \
#     SWITCHES="graph_memset_kernels=true pdl=true" FASTTRAIN_GIT_SHA=abc1234 \
#     bash benchmarks/h200_switch_ab.sh
LANE_BUDGET=${LANE_BUDGET:-585}
. "$(dirname "$0")/lanes.sh"
W=${WORKLOAD:-vit}
P=${PRESET:-benchmarks/results/presets/vit-base-stream.toml}
read -r -a SW <<< "${SWITCHES:-}"
VARIANTS=("" "${SW[@]/#/--set }")
( export FASTTRAIN_CACHE=/tmp/ftcache0
  for v in "${VARIANTS[@]}"; do
    timeout 300 python3 -m fasttrain train "$W" --size base --steps 2 --warmup 1 --recipe "$P" \
      $v > "$OUT/warm-${v##* }.out" 2>&1 &
  done
  wait )
echo "compiled after $(( $(date +%s) - LANE_END + LANE_BUDGET )) s"
grep -l -i 'error' "$OUT"/warm-*.out || true
cmds=(); n=0
order=("${VARIANTS[@]}"); for ((i=${#VARIANTS[@]}-1; i>=0; i--)); do order+=("${VARIANTS[i]}"); done
for v in "${order[@]}"; do
  cmds+=("FASTTRAIN_GIT_SHA=${FASTTRAIN_GIT_SHA:-new} $TRAIN_CMD $W --recipe $P $v > $OUT/run-$n-$W.out")
  n=$((n + 1))
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep '^==' "$OUT/lanes.log"
python3 benchmarks/train_rows.py "$OUT"
