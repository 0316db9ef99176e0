#!/usr/bin/env bash
# One H200: a switch measured in `fasttrain train` A/B runs, one after the other on the same GPU.
# GPU_TESTS (a pytest -k expression) runs those gpu-marked tests first, MICRO (groups of
# kernels_micro.py, comma-separated) that microbenchmark next; then each WORKLOAD:PRESET in
# PRESETS is trained as it is and with SWITCH (KEY=VALUE), and EXTRA="WORKLOAD:PRESET:KEY=VALUE
# ..." adds runs with other switches. The train rows land in $OUT/train-*.jsonl (train_rows.py).
#   GPU_TESTS=group_norm MICRO=groupnorm SWITCH=kernels=groupnorm \
#     PRESETS=sd:benchmarks/results/presets/fast-sd-base-20261121-101013.toml bash benchmarks/runs/h200_train_ab.sh
. "$(dirname "$0")/lanes.sh"
SWITCH=${SWITCH:-optimizer_impl=triton}
cmds=()
add_gpu_tests
[ -n "${MICRO:-}" ] && cmds+=("python3 benchmarks/kernels/kernels_micro.py --only $MICRO --out $OUT/kernels-micro-${MICRO//,/-}.jsonl")
i=0
for p in ${PRESETS:-}; do
  w=${p%%:*}; f=${p#*:}
  cmds+=("$TRAIN_CMD $w --recipe $f > $OUT/run-$((i++))-$w.out"
         "$TRAIN_CMD $w --recipe $f --set $SWITCH > $OUT/run-$((i++))-$w.out")
done
for e in ${EXTRA:-}; do
  IFS=: read -r w f kv <<< "$e"
  cmds+=("$TRAIN_CMD $w --recipe $f --set $kv > $OUT/run-$((i++))-$w.out")
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep -v '^USDT' "$OUT/lanes.log" | grep -v '^E1\|^  \|Warning\|warn' | tail -c 6000
python3 benchmarks/runs/train_rows.py "$OUT"
