#!/usr/bin/env bash
# Run fasttrain ladders on the GPU machine and leave the rows under $OUT.
# usage: benchmarks/runs/gpu_ladder.sh "WORKLOAD[:SIZE]..." [extra ladder args]
# Wheels for the peers (diffusers, liger-kernel) are installed from .peerwheels/ when present.
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FASTTRAIN_CACHE=${FASTTRAIN_CACHE:-/tmp/fasttrain-cache}
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .peerwheels ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peerwheels/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
elif [ -d /tmp/site ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,temperature.gpu --format=csv,noheader
workloads=$1; shift
for w in $workloads; do
  name=${w%%:*}; size=base; [ "$name" != "$w" ] && size=${w#*:}
  python3 -m fasttrain ladder "$name" --size "$size" --out "$OUT" "$@" 2>&1 | grep -v '^USDT'
done
