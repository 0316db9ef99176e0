#!/usr/bin/env bash
# All four ladders with their peers in one call on a 4 x H200 machine: one lane per GPU, each
# lane pinned to its own 16 cores, so the 10-minute command limit holds the whole measurement.
# Rows land in $OUT/*.jsonl, the lanes' logs in $OUT/lanes.log.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peerwheels/*.whl \
  && export PYTHONPATH=src:/tmp/site
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,temperature.gpu --format=csv,noheader
lane() {  # lane GPU CORES COMMAND...
  local gpu=$1 cores=$2; shift 2
  ( export CUDA_VISIBLE_DEVICES=$gpu FASTTRAIN_CACHE=/tmp/ftcache$gpu
    for cmd in "$@"; do echo "== gpu$gpu: $cmd"; taskset -c "$cores" bash -c "$cmd"; done
  ) > "/tmp/lane$gpu.log" 2>&1 &
}
L="python3 -m fasttrain ladder --out $OUT --rung-timeout 420"
lane 0 0-15  "$L sd --size base --warmup 3 --rungs default"
lane 1 16-31 "$L swin --size base --peer" "python3 -m pytest -q -m gpu tests/test_gpu.py"
lane 2 32-47 "$L llama --size base --peer"
lane 3 48-63 "$L vit --size base --peer" "$L sd --size base --rungs none --peer --warmup 3"
wait
for g in 0 1 2 3; do grep -v '^USDT' /tmp/lane$g.log; done > "$OUT/lanes.log"
tail -c 6000 "$OUT/lanes.log"
