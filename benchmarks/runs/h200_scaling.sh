#!/usr/bin/env bash
# Issue 5 evidence on a multi-GPU H200 machine (NVLink multicast stays off): per-GPU throughput,
# efficiency and memory for llama (ddp / zero2 / zero3, regional compile) and swin (ddp / zero2,
# eager) at WORLDS process counts (default 1,2,4,8; the committed rows are 1,2,4 on 4 GPUs).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/ftcache
OUT=${OUT:-out}; mkdir -p "$OUT"; WORLDS=${WORLDS:-1,2,4,8}
F="--set precision=bf16-mixed --set optimizer_impl=fused --set attention=auto"
python3 -m fasttrain scaling llama --size base --worlds "$WORLDS" --sharding ddp,zero2,zero3 \
  --per-gpu-batch 4 $F --set compile=regional --out "$OUT" --warmup 3
python3 -m fasttrain scaling swin --size base --worlds "$WORLDS" --sharding ddp,zero2 \
  --per-gpu-batch 64 $F --set workers=6 --set pin_memory=true --set non_blocking=true \
  --out "$OUT" --warmup 3
