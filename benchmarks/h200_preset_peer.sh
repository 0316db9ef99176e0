#!/usr/bin/env bash
# H200s: each WORKLOAD:PRESET of PRESETS measured against the peer in one ladder run (the fp32
# parity base, the preset file as its own rung, the peer, then the peer and the preset again to
# confirm the ratio), without searching again. On a machine with several GPUs the presets run
# side by side, preset k on GPU k mod GPUs with its own 16 cores. WORKLOAD:PRESET:none (or
# BASE=none for all) skips the fp32 parity base: the preset is then its own reference (for
# presets whose search already showed their parity, where the base would not fit the call). GPU_TESTS (a pytest -k
# expression) runs those gpu-marked tests first on GPU 0, and TRAIN="WORKLOAD:PRESET ..." adds
# `fasttrain train` rows of other recipes after, on GPU 0 (train_rows.py reads them).
#   PRESETS=swin:benchmarks/results/presets/swin-base-layernorm.toml bash benchmarks/h200_preset_peer.sh
. "$(dirname "$0")/lanes.sh"
gpus=$(nvidia-smi -L | wc -l)
declare -A lanes
cmds=()
add_gpu_tests
lanes[0]=""
k=0
for p in ${PRESETS:-}; do
  IFS=: read -r w f b <<< "$p"
  g=$(( k++ % gpus ))
  lanes[$g]+="python3 -m fasttrain ladder $w --size base --out $OUT --warmup 3 --rungs ${b:-${BASE:-fp32}} --recipe $f --peer"$'\n'
done
i=0
for p in ${TRAIN:-}; do
  lanes[0]+="$TRAIN_CMD ${p%%:*} --recipe ${p#*:} > $OUT/run-$((i++))-${p%%:*}.out"$'\n'
done
for g in "${!lanes[@]}"; do
  mapfile -t mine < <(printf '%s' "${lanes[$g]}")
  [ "$g" = 0 ] && mine=("${cmds[@]}" "${mine[@]}")
  [ ${#mine[@]} -gt 0 ] && lane "$g" "$(( g * 16 ))-$(( g * 16 + 15 ))" "${mine[@]}"
done
finish_lanes
grep -v '^USDT' "$OUT/lanes.log" | grep '^== \|^│\|rows:\|passed\|failed\|rror\|best fasttrain\|warning: the ratio' | tail -c 9000
[ -n "${TRAIN:-}" ] && python3 benchmarks/train_rows.py "$OUT"
true
