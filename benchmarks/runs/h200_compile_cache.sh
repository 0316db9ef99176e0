#!/usr/bin/env bash
# One H200: what compile_cache saves on a fresh machine. Each WORKLOAD:PRESET in PRESETS
# (default: SD's and Swin's fast presets) is trained twice with compile_cache=true, each run
# with its own empty Inductor and Triton cache folders (as on a fresh machine): the first
# compiles from scratch and saves the cache file, the second has only that file. Rows land in
# $OUT/train-WORKLOAD.jsonl; compare their warmup_s.
. "$(dirname "$0")/lanes.sh"
T="python3 -m fasttrain train --size base --steps 20 --warmup 5 --set compile_cache=true"
cmds=(); i=0
for p in ${PRESETS:-sd:benchmarks/results/presets/fast-sd-base-20261121-101013.toml swin:benchmarks/results/presets/fast-swin-base-20261121-090006.toml}; do
  w=${p%%:*}; f=${p#*:}
  for run in cold cached; do
    cmds+=("TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$w-$run TRITON_CACHE_DIR=/tmp/tri-$w-$run $T $w --recipe $f > $OUT/run-$((i++))-$w.out")
  done
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep -v '^USDT' "$OUT/lanes.log" | grep '^== \|rror' | tail -c 3000
python3 benchmarks/runs/train_rows.py "$OUT"
