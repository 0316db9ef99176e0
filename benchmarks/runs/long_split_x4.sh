#!/usr/bin/env bash
# One long run per GPU at once, for a tighter long-run parity check than long_parity_x4.sh:
# Llama-3.2-1B at 4 x 2,048 tokens (the preset's batch; four times the tokens per step, so less
# run-to-run noise), 2,000 steps: GPU 0 and 1 the bf16-mixed baseline twice (its noise), GPU 2
# bf16 weights with fp32 masters, GPU 3 the bf16 residual stream. fasttrain train rows with
# every step's loss under $OUT/gpuN; benchmarks/runs/long_verdicts.py --train judges them.
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FASTTRAIN_CACHE=${FASTTRAIN_CACHE:-/tmp/fasttrain-cache}
OUT=${OUT:-out}
steps=${STEPS:-2000}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
base=(--set fp8=none --set stream_dtype=auto --set master_weights=false)
switch=("" "" "--set master_weights=true" "--set stream_dtype=bf16")
for i in 0 1 2 3; do
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$i python3 -m fasttrain train llama --size base --preset llama-base \
    --batch 4 --steps "$steps" --warmup 5 "${base[@]}" ${switch[$i]} \
    --out "$OUT/gpu$i" > "$OUT/log-gpu$i.txt" 2>&1 &
done
wait
grep -h -v '^USDT' "$OUT"/log-gpu*.txt | grep -E '^(fasttrain|row|loss)' | head -20
ls "$OUT"/gpu*
