#!/usr/bin/env bash
# One H200: each WORKLOAD:PRESET of PRESETS measured against the peer in one ladder run (the fp32
# parity base, the preset file as its own rung, the peer), without searching again; GPU_TESTS
# (a pytest -k expression) runs those gpu-marked tests first, and TRAIN="WORKLOAD:PRESET ..."
# adds `fasttrain train` rows of other recipes after (train_rows.py reads them).
#   PRESETS=swin:benchmarks/results/presets/swin-base-layernorm.toml bash benchmarks/h200_preset_peer.sh
. "$(dirname "$0")/lanes.sh"
cmds=()
add_gpu_tests
for p in ${PRESETS:-}; do
  cmds+=("python3 -m fasttrain ladder ${p%%:*} --size base --out $OUT --warmup 3 --rungs fp32 --recipe ${p#*:} --peer")
done
i=0
for p in ${TRAIN:-}; do
  cmds+=("$TRAIN_CMD ${p%%:*} --recipe ${p#*:} > $OUT/run-$((i++))-${p%%:*}.out")
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep -v '^USDT' "$OUT/lanes.log" | grep '^== \|^│\|rows:\|passed\|failed\|rror' | tail -c 8000
[ -n "${TRAIN:-}" ] && python3 benchmarks/train_rows.py "$OUT"
true
