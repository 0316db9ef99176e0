#!/usr/bin/env bash
# Fault handling on CUDA (2 GPUs): the gpu-marked tests of torchrun faults (a rank hung inside a
# step, named before NCCL's own timeout) and of the training loop (fp16's GradScaler skipped
# steps among them). Logs under $OUT.
set -u
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${PYTEST_TIMEOUT:-500} python3 -m pytest -q -m gpu tests/run/test_distributed_gpu.py ${LOOP_TESTS-tests/run/test_loop_gpu.py} \
  -p no:cacheprovider -rA 2>&1 | grep -v '^USDT' | tail -n 30 | tee "$OUT/gpu-faults-tests.txt"
