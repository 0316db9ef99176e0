#!/usr/bin/env bash
# One H200: the GPU tests (the compiled Triton norms, the fused linear + cross-entropy), the
# kernel microbenchmarks against eager and compiled references, and the Llama ladder's top rungs
# with the fused-kernels rung against the peer in one run.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/ftcache
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peerwheels/*.whl \
  && export PYTHONPATH=src:/tmp/site
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/ 2>&1 | tail -3
timeout 200 python3 benchmarks/kernels/kernels_micro.py --out "$OUT/kernels-micro-$(date +%Y%m%d-%H%M%S).jsonl"
timeout 300 python3 -m fasttrain ladder llama --size base --from cuda-graphs --peer --warmup 3 \
  --out "$OUT" 2>&1 | grep -v USDT | tail -20
