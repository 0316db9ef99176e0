#!/usr/bin/env bash
# One H200: shape padding on variable-length Llama batches (profile with and without
# pad_multiple: compiled graphs, warm-up, cudaMalloc per step, reserved-memory pattern), then the
# ViT-L memory ladder again with the FLOP probe's cached blocks released.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/ftcache
OUT=${OUT:-out}; mkdir -p "$OUT"
F="--set precision=bf16-mixed --set optimizer_impl=fused --set attention=auto --set compile=model"
for pad in 0 2048; do
  timeout 200 python3 -m fasttrain profile llama --size base --opt varlen=True $F \
    --set pad_multiple=$pad --steps 10 --out "$OUT/pad$pad"
done
timeout 260 python3 -m fasttrain ladder vit --size large --rungs memory --batch 256 --warmup 3 \
  --out "$OUT"
( cd "$OUT" && find . -name '*.json.gz' -delete )
