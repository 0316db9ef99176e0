#!/usr/bin/env bash
# One GPU: issue 6's Llama items in one call. (1) the RMSNorm kernels (kernels=rmsnorm) and the
# bf16 residual stream (stream_dtype=bf16) on top of the fast preset, runs A B C D D C B A;
# (2) padded GEMM widths (gemm_pad=64) at GPT-2's odd vocabulary (--opt vocab=50257), runs
# A B B A; (3) benchmarks/gemm_pad_micro.py. Every recipe (and the gpu-marked tests of
# GPU_TESTS) compiles once side by side first, so the measured runs start from warm caches.
# Rows: $OUT/train-llama.jsonl (run order), $OUT/gemm-pad-micro.jsonl.
#   FASTTRAIN_GIT_SHA=abc1234 GPU_TESTS="rms_norm or padded_gemm" bash benchmarks/h200_llama_items.sh
LANE_BUDGET=${LANE_BUDGET:-585}
. "$(dirname "$0")/lanes.sh"
D=benchmarks/results/presets
BASE=$D/fast-llama-base-20261121-101957.toml
declare -A P=([base]=$BASE [rms]=$D/llama-base-rmsnorm.toml [stream]=$D/llama-base-stream.toml
              [both]=$D/llama-base-rmsnorm-stream.toml [pad]=$D/llama-base-gemm-pad.toml)
V="--opt vocab=50257"
( export FASTTRAIN_CACHE=/tmp/ftcache0
  [ -n "${GPU_TESTS:-}" ] && timeout 300 python3 -m pytest -q -m gpu tests/test_gpu.py \
    -k "$GPU_TESTS" --tb=short > "$OUT/gpu-tests.txt" 2>&1 &
  for k in base rms stream both; do
    timeout 240 python3 -m fasttrain train llama --size base --steps 2 --warmup 1 \
      --recipe "${P[$k]}" > "$OUT/warm-$k.out" 2>&1 &
  done
  for k in base pad; do
    timeout 240 python3 -m fasttrain train llama --size base --steps 2 --warmup 1 $V \
      --recipe "${P[$k]}" > "$OUT/warm-v$k.out" 2>&1 &
  done
  wait )
echo "compiled after $(( $(date +%s) - LANE_END + LANE_BUDGET )) s"
tail -n 3 "$OUT"/warm-*.out | grep -i 'error\|==>' || true
[ -n "${GPU_TESTS:-}" ] && tail -n 5 "$OUT/gpu-tests.txt"
run() { echo "FASTTRAIN_GIT_SHA=${FASTTRAIN_GIT_SHA:-new} $TRAIN_CMD llama --recipe ${P[$1]} ${2:-} > $OUT/run-$3-llama.out"; }
lane 0 0-15 "PYTHONPATH=src:benchmarks python3 benchmarks/gemm_pad_micro.py > $OUT/gemm-pad-micro.out 2>&1" \
  "$(run base '' 0)" "$(run rms '' 1)" "$(run stream '' 2)" "$(run both '' 3)" \
  "$(run both '' 4)" "$(run stream '' 5)" "$(run rms '' 6)" "$(run base '' 7)" \
  "$(run base "$V" 8)" "$(run pad "$V" 9)" "$(run pad "$V" 10)" "$(run base "$V" 11)"
finish_lanes
grep '^==' "$OUT/lanes.log"
tail -n 20 "$OUT/gemm-pad-micro.out"
python3 benchmarks/train_rows.py "$OUT"
