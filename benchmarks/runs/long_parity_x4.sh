#!/usr/bin/env bash
# The 2,000-step curves on a 4-GPU machine, one curve pair per GPU at once: Llama-3.2-1B
# (1 x 2,048 tokens) fp8 / bf16 stream / bf16 weights on GPUs 0-2, and ViT-B/16 (batch 128, on
# learnable images) with all three switches on GPU 3. Each GPU's rows go to $OUT/gpuN.
set -u
OUT=${OUT:-out}
here=$(dirname "$0")
steps=${STEPS:-2000}
mkdir -p "$OUT"
for i in 0 1 2; do
  v=(fp8 bf16-stream bf16-weights)
  CUDA_VISIBLE_DEVICES=$i OUT=$OUT/gpu$i "$here/long_parity.sh" llama llama-base 1 "$steps" \
    --rungs "${v[$i]}" > "$OUT/log-gpu$i.txt" 2>&1 &
done

CUDA_VISIBLE_DEVICES=3 VIT_DATA=1 OUT=$OUT/gpu3 "$here/long_parity.sh" vit vit-base 128 "$steps" \
  --data /tmp/ft-data/train > "$OUT/log-gpu3.txt" 2>&1 &
wait
tail -n 12 "$OUT"/log-gpu*.txt
