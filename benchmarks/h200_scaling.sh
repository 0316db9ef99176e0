#!/usr/bin/env bash
# Issue 5 evidence on an 8 x H200 machine (NVLink multicast stays off): scaling tables for
# llama and swin at 1/2/4/8 GPUs, per-GPU memory for ddp / zero2 / zero3, fast recipe.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/ftcache
OUT=${OUT:-out}; mkdir -p "$OUT"
FAST="--set precision=bf16-mixed --set optimizer_impl=fused --set attention=auto --set compile=regional"
python3 -m fasttrain scaling llama --size base --worlds 1,2,4,8 --sharding ddp,zero2,zero3 \
  --per-gpu-batch 4 $FAST --out "$OUT" --warmup 3
python3 -m fasttrain scaling swin --size base --worlds 1,2,4,8 --sharding ddp,zero2 \
  --per-gpu-batch 64 $FAST --set workers=6 --set pin_memory=true --out "$OUT" --warmup 3
