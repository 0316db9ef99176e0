#!/usr/bin/env bash
# One H200: the one-launch optimizer (optimizer_impl=triton). Its GPU tests, the optimizer
# microbenchmark (SD, Llama-1B, ViT-B weights), then `fasttrain train` of each preset in PRESETS
# (default: SD's fast preset) as it is and with the one-launch optimizer, one after the other on
# the same GPU; EXTRA="swin:FILE:KEY=VALUE ..." adds more train runs. Rows land under $OUT.
. "$(dirname "$0")/lanes.sh"
T="python3 -m fasttrain train --size base --steps 30 --warmup 5"
cmds=("python3 -m pytest -q -m gpu tests/test_gpu.py -k 'window or one_launch' 2>&1 | tail -15"
      "python3 benchmarks/kernels_micro.py --only optimizer --out $OUT/kernels-micro-optimizer.jsonl")
for p in ${PRESETS:-sd:benchmarks/results/presets/fast-sd-base-20261121-060953.toml}; do
  w=${p%%:*}; f=${p#*:}
  cmds+=("$T $w --recipe $f | tail -1 >> $OUT/train-$w.jsonl"
         "$T $w --recipe $f --set optimizer_impl=triton | tail -1 >> $OUT/train-$w.jsonl")
done
for e in ${EXTRA:-}; do
  IFS=: read -r w f kv <<< "$e"
  cmds+=("$T $w --recipe $f --set $kv | tail -1 >> $OUT/train-$w.jsonl")
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep -v '^USDT' "$OUT/lanes.log" | grep '^== \|passed\|failed\|rror\|^optimizer' | tail -c 8000
for f in "$OUT"/train-*.jsonl; do [ -f "$f" ] && python3 -c "
import json,sys
for l in open('$f'):
    r=json.loads(l); print(r.get('workload'), r['recipe'].get('optimizer_impl'), r['recipe'].get('compile_mode'), r.get('throughput'), r.get('step_time_s'), r.get('warmup_s'), r.get('error'), r.get('warnings'))
"; done
