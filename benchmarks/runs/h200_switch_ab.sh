#!/usr/bin/env bash
# One GPU: switches on top of a preset, `fasttrain train` runs A B C … C B A (A the preset, each
# later letter the preset with one entry of SWITCHES: `key=value`, or several joined by `+`,
# each set via --set), so a linear drift of the machine cancels out of each pair. OPTS (e.g.
# "--opt vocab=50257") go to every run. Every variant compiles once side by side first (two
# steps each; GPU_TESTS, a pytest -k expression, runs beside them), so the measured runs start
# from warm caches. Rows: $OUT/train-WORKLOAD.jsonl, in run order.
#   WORKLOAD=vit PRESET=benchmarks/results/presets/vit-base-stream.toml \
#     SWITCHES="graph_memset_kernels=true pdl=true" FASTTRAIN_GIT_SHA=abc1234 \
#     bash benchmarks/runs/h200_switch_ab.sh
#   WORKLOAD=llama PRESET=benchmarks/results/presets/fast-llama-base-20261121-101957.toml \
#     SWITCHES="kernels=rmsnorm stream_dtype=bf16 kernels=rmsnorm+stream_dtype=bf16" ...
LANE_BUDGET=${LANE_BUDGET:-585}
. "$(dirname "$0")/lanes.sh"
W=${WORKLOAD:-vit}
P=${PRESET:-benchmarks/results/presets/vit-base-stream.toml}
O=${OPTS:-}
VARIANTS=("")
for s in ${SWITCHES:-}; do VARIANTS+=("--set ${s//+/ --set }"); done
( export FASTTRAIN_CACHE=/tmp/ftcache0
  [ -n "${GPU_TESTS:-}" ] && timeout 300 python3 -m pytest -q -m gpu tests/ \
    -k "$GPU_TESTS" --tb=short > "$OUT/gpu-tests.txt" 2>&1 &
  for i in "${!VARIANTS[@]}"; do
    timeout 300 python3 -m fasttrain train "$W" --size base --steps 2 --warmup 1 --recipe "$P" \
      $O ${VARIANTS[i]} > "$OUT/warm-$i.out" 2>&1 &
  done
  wait )
echo "compiled after $(( $(date +%s) - LANE_END + LANE_BUDGET )) s"
grep -l -i 'error' "$OUT"/warm-*.out || true
[ -n "${GPU_TESTS:-}" ] && tail -n 3 "$OUT/gpu-tests.txt"
order=("${VARIANTS[@]}"); for ((i=${#VARIANTS[@]}-1; i>=0; i--)); do order+=("${VARIANTS[i]}"); done
cmds=()
for v in "${order[@]}"; do
  cmds+=("FASTTRAIN_GIT_SHA=${FASTTRAIN_GIT_SHA:-new} $TRAIN_CMD $W --recipe $P $O $v > $OUT/run-${#cmds[@]}-$W.out")
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep '^==' "$OUT/lanes.log"
python3 benchmarks/runs/train_rows.py "$OUT"
