#!/usr/bin/env bash
# One H200: optionally a microbenchmark (MICRO), then the fast preset search (greedy, one rung per
# switch) with the peer in the same run, for the workloads named in WORKLOADS (default
# "llama vit"); each search's rows and preset land under $OUT. LANE_BUDGET bounds the whole call.
. "$(dirname "$0")/lanes.sh"
L="python3 -m fasttrain ladder --out $OUT --warmup 3 --rungs fast --peer --size base"
cmds=()  # GPU_TESTS="-k window" runs those gpu-marked tests first;
# MICRO=fp8 (or other groups of kernels_micro.py, comma-separated) runs that microbenchmark next
[ -n "${GPU_TESTS:-}" ] && cmds+=("python3 -m pytest -q -m gpu tests/ $GPU_TESTS 2>&1 | tail -25")
[ -n "${MICRO:-}" ] && cmds+=("python3 benchmarks/kernels/kernels_micro.py --only $MICRO --out $OUT/kernels-micro-${MICRO//,/-}.jsonl")
for w in ${WORKLOADS:-llama vit}; do cmds+=("$L $w"); done
lane 0 0-15 "${cmds[@]}"
finish_lanes
( cd "$OUT" && find . -name '*.jsonl' -o -name '*.toml' | tar czf rows.tgz -T - \
  && find . -mindepth 1 ! -name rows.tgz ! -name lanes.log -delete )
grep -v '^USDT' "$OUT/lanes.log" | grep '^== \|^│\|fast preset\|rows:\|^[a-z+-]* [0-9]\|passed\|failed\|rror' | tail -c 11000
