#!/usr/bin/env bash
# The inference ladder on a model fasttrain trained to non-trivial accuracy, on the GPU machine.
# usage: benchmarks/runs/infer_trained.sh MODEL TRAIN_STEPS LR [extra infer args]
#   e.g. benchmarks/runs/infer_trained.sh vit_base_patch16_224 400 3e-4 --rungs default
#   (BATCH=N sets the training batch, default 64; LR_WARMUP=N warms the rate up over the first
#   N steps, default 0: Swin-B at 2e-4 and 3e-4 without one stayed at chance)
# 1. learnable labelled images (gratings by class, noisy, occluded; workloads/data.py
#    write_pattern_images): a training set and a held-out evaluation set from other seeds;
# 2. fasttrain train of timm:MODEL on the training set, saved as a checkpoint;
# 3. fasttrain infer on the held-out set with the checkpoint's weights, peers in the same run,
#    the fastest passing rung exported and checked in a process that imports torch only.
# Rows land under $OUT (train row, inference rows); logs on stdout.
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FASTTRAIN_CACHE=${FASTTRAIN_CACHE:-/tmp/fasttrain-cache}
OUT=${OUT:-out}
model=$1; steps=$2; lr=$3; shift 3
mkdir -p "$OUT" /tmp/ft-data
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
t0=$(date +%s)
python3 - <<PY
from pathlib import Path
from concurrent.futures import ProcessPoolExecutor
from fasttrain.workloads.data import write_pattern_images
jobs = [("train", 3072, 1), ("eval", 1024, 2)]
with ProcessPoolExecutor(2) as ex:
    futs = [ex.submit(write_pattern_images, Path("/tmp/ft-data") / n, c, 240, 10, s) for n, c, s in jobs]
    [f.result() for f in futs]
PY
echo "data: $(( $(date +%s) - t0 )) s"
rm -rf /tmp/ft-ckpt
# trained eagerly (bf16 autocast, fused AdamW, cosine): no compile time spent on a model that is
# only the subject of the inference ladder
python3 -m fasttrain train "timm:$model" --size base --batch "${BATCH:-64}" \
  --data /tmp/ft-data/train --steps "$steps" --warmup 0 --set lr="$lr" --set schedule=cosine \
  --set lr_warmup="${LR_WARMUP:-0}" \
  --set precision=bf16-mixed --set optimizer_impl=fused --set attention=auto --set workers=12 \
  --set pin_memory=true --save /tmp/ft-ckpt --out "$OUT" 2>&1 | grep -v '^USDT' | \
  grep -E '^(fasttrain|batch|step|throughput|loss|row)' || true
echo "train: $(( $(date +%s) - t0 )) s"
python3 -m fasttrain infer "timm:$model" --size base --checkpoint /tmp/ft-ckpt \
  --data /tmp/ft-data/eval --out "$OUT" "$@" 2>&1 | grep --line-buffered -v '^USDT'
echo "infer: $(( $(date +%s) - t0 )) s"
