#!/usr/bin/env bash
# Issue 3 evidence on one H200: the sd profile of the tf32 baseline and of the best recipe, the
# advisor on all four baselines (tf32, as the source starts), and one suggested recipe measured
# by the ladder. Rows and traces land under $OUT.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/ftcache
OUT=${OUT:-out}; mkdir -p "$OUT"
P="python3 -m fasttrain profile --out $OUT --steps 10"
$P sd --size base --set precision=tf32 --suggest-recipe "$OUT/sd-suggested.toml"
$P sd --size base --set precision=bf16-mixed --set optimizer_impl=fused --set attention=auto \
  --set workers=8 --set pin_memory=true --set device_prefetch=true --set compile=regional
for w in vit swin llama; do $P $w --size base --set precision=tf32 --steps 6; done
python3 -m fasttrain ladder sd --size base --recipe "$OUT/sd-suggested.toml" --out "$OUT" --warmup 3
python3 -m pytest -q -m gpu tests/test_gpu.py
