#!/usr/bin/env bash
# One H200: the one-launch optimizer (optimizer_impl=triton). Its GPU tests, optionally the
# optimizer microbenchmark (MICRO=1: SD, Llama-1B and ViT-B weights), then `fasttrain train` of
# each WORKLOAD:PRESET in PRESETS as it is and with the one-launch optimizer, one after the other
# on the same GPU; EXTRA="WORKLOAD:PRESET:KEY=VALUE ..." adds more train runs. The train rows
# land in $OUT/train-WORKLOAD.jsonl, one line each.
. "$(dirname "$0")/lanes.sh"
T="python3 -m fasttrain train --size base --steps 30 --warmup 5"
cmds=("python3 -m pytest -q -m gpu tests/test_gpu.py -k '${GPU_TESTS:-one_launch}' --tb=short 2>&1 | grep -v Warning | tail -40")
[ -n "${MICRO:-}" ] && cmds+=("python3 benchmarks/kernels_micro.py --only optimizer --out $OUT/kernels-micro-optimizer.jsonl")
i=0
for p in ${PRESETS:-sd:benchmarks/results/presets/fast-sd-base-20261121-060953.toml}; do
  w=${p%%:*}; f=${p#*:}
  cmds+=("$T $w --recipe $f > $OUT/run-$((i++))-$w.out"
         "$T $w --recipe $f --set optimizer_impl=triton > $OUT/run-$((i++))-$w.out")
done
for e in ${EXTRA:-}; do
  IFS=: read -r w f kv <<< "$e"
  cmds+=("$T $w --recipe $f --set $kv > $OUT/run-$((i++))-$w.out")
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep -v '^USDT' "$OUT/lanes.log" | grep -v '^E1\|^  \|Warning\|warn' | tail -c 6000
python3 benchmarks/train_rows.py "$OUT"
