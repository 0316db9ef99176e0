#!/usr/bin/env bash
# Long-run parity on the GPU machine: the bf16-mixed baseline and each numerics switch (fp8
# linears, the bf16 residual stream, bf16 weights with fp32 masters) trained STEPS steps each
# from the same initialisation on the same batches, their loss curves compared
# (fasttrain ladder --long; the verdict rule is in src/fasttrain/measure/curves.py).
# usage: benchmarks/runs/long_parity.sh WORKLOAD PRESET BATCH STEPS [extra ladder args]
#   e.g. benchmarks/runs/long_parity.sh llama llama-base 1 2000
#        benchmarks/runs/long_parity.sh vit vit-base 32 2000 --data /tmp/ft-data/train
# VIT_DATA=1 first writes learnable labelled images (workloads/data.py write_pattern_images)
# to /tmp/ft-data/train, so that the ViT's curve is learning, not memorising random labels.
# Rows land under $OUT; logs on stdout.
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FASTTRAIN_CACHE=${FASTTRAIN_CACHE:-/tmp/fasttrain-cache}
OUT=${OUT:-out}
workload=$1; preset=$2; batch=$3; steps=$4; shift 4
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
if [ "${VIT_DATA:-0}" = 1 ]; then
python3 - <<PY
from pathlib import Path
from fasttrain.workloads.data import write_pattern_images
write_pattern_images(Path("/tmp/ft-data/train"), 4096, 256, 10, 1)
PY
echo "data: $(( $(date +%s) - t0 )) s"
fi
python3 -m fasttrain ladder "$workload" --size base --preset "$preset" --batch "$batch" \
  --long "$steps" --warmup 5 --out "$OUT" "$@" 2>&1 | grep --line-buffered -v '^USDT'
echo "long: $(( $(date +%s) - t0 )) s"
