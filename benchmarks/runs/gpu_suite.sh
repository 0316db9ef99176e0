#!/usr/bin/env bash
# One GPU: the whole GPU suite in one process (`pytest -m gpu tests/`), as CI would run it on a
# CUDA machine, with faulthandler on so that a crash names its frame. DESELECT (pytest node ids,
# space-separated) skips tests an earlier call already ran, for a suite longer than one call.
# Writes $OUT/gpu-tests.txt (the log) and $OUT/gpu-tests.xml (JUnit: every test's outcome).
#   bash benchmarks/runs/gpu_suite.sh
#   DESELECT="tests/x.py::test_a tests/y.py::test_b" bash benchmarks/runs/gpu_suite.sh
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
args=()
for t in ${DESELECT:-}; do args+=(--deselect "$t"); done
timeout "${SUITE_BUDGET:-560}" python3 -m pytest -m gpu tests/ -p no:cacheprovider -q -rs \
  --tb=short --durations=15 --junitxml="$OUT/gpu-tests.xml" "${args[@]}" > "$OUT/gpu-tests.txt" 2>&1
echo "pytest exit $?" >> "$OUT/gpu-tests.txt"
tail -n 25 "$OUT/gpu-tests.txt"
