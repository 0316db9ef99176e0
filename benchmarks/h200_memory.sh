#!/usr/bin/env bash
# Issue 4 evidence on one H200: the ViT-L/16 memory ladder (goal: >= 20x lower peak than fp32 at
# the same effective batch), then `fit` for the four workloads with the fast recipe.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/ftcache
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m fasttrain ladder vit --size large --rungs memory --out "$OUT" --warmup 3
FAST="--set precision=bf16-mixed --set optimizer_impl=fused --set attention=auto"
for w in vit swin llama sd; do
  python3 -m fasttrain fit $w --size base $FAST --out "$OUT" --max-batch 4096
done
