#!/usr/bin/env bash
# H200s: each WORKLOAD:PRESET of PRESETS measured against the peer in one ladder run (the fp32
# parity base, the preset file as its own rung, then the ratio's confirmation: the preset, the
# peer, the peer again, the preset again, and a third run of a side not yet confirmed), without
# searching again. On a machine with several GPUs the presets run side by side, preset k on GPU
# k mod GPUs with its own 16 cores and rows folder ($OUT/gpuK). WORKLOAD:PRESET:none (or
# BASE=none for all) skips the fp32 parity base: the preset is then its own reference (for
# presets whose search already showed their parity, where the base would not fit the call).
# Side by side, the peers that run without CUDA graphs (Swin's, SD's) are slowed by the other
# lanes; the confirmation says so. GPU_TESTS (a pytest -k expression) runs those gpu-marked
# tests first, before any lane starts; TRAIN="WORKLOAD:PRESET ..." adds `fasttrain train` rows
# of other recipes after the presets of GPU 0 (train_rows.py reads them).
# A workload whose name has a colon (timm:NAME) is written WORKLOAD=PRESET[=BASE] instead.
#   PRESETS=swin:benchmarks/results/presets/swin-base-layernorm.toml bash benchmarks/runs/h200_preset_peer.sh
. "$(dirname "$0")/lanes.sh"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || { echo "no GPU found (nvidia-smi -L)"; exit 1; }
cmds=()
add_gpu_tests
for c in "${cmds[@]}"; do bash -c "$c"; done  # alone on the machine, before the lanes
lanes=()
k=0
for p in ${PRESETS:-}; do
  if [[ $p == *=* ]]; then IFS='=' read -r w f b <<< "$p"; else IFS=: read -r w f b <<< "$p"; fi
  g=$(( k++ % gpus ))
  lanes[g]+="python3 -m fasttrain ladder $w --size base --out $OUT/gpu$g --warmup 3 --rungs ${b:-${BASE:-fp32}} --recipe $f --peer"$'\n'
done
i=0
for p in ${TRAIN:-}; do
  lanes[0]+="$TRAIN_CMD ${p%%:*} --recipe ${p#*:} > $OUT/run-$((i++))-${p%%:*}.out"$'\n'
done
for g in "${!lanes[@]}"; do
  mapfile -t mine < <(printf '%s' "${lanes[g]}")
  lane "$g" "$(( g * 16 ))-$(( g * 16 + 15 ))" "${mine[@]}"
done
finish_lanes
grep -v '^USDT' "$OUT/lanes.log" | grep '^== \|^│\|rows:\|rror\|best fasttrain\|warning: the ratio' | tail -c 9000
[ -n "${TRAIN:-}" ] && python3 benchmarks/runs/train_rows.py "$OUT"
true
