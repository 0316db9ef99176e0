#!/usr/bin/env bash
# One H200: a preset against the peer in one ladder run (the preset as its own reference, then
# ours, peer, peer, ours and the tie-breakers), after both sides have compiled once side by side
# (two runs of two steps) so that every rung of the ladder starts from warm Inductor and Triton
# caches. For workloads whose cold compile would leave no room in one call for the
# confirmation and its tie-breakers (SD: ~190 s ours and ~170 s the peer, cold). The rungs'
# warm-up seconds are then warm-cache figures; their throughput is what the ratio uses.
# RUNGS=fp32: the fp32 baseline first, the parity reference of the preset (default none: the
# preset is its own reference).
#   WORKLOAD=sd PRESET=benchmarks/results/presets/sd-base-layernorm.toml bash benchmarks/runs/h200_ladder_warm.sh
LANE_BUDGET=${LANE_BUDGET:-588}
. "$(dirname "$0")/lanes.sh"
W=${WORKLOAD:-sd}
P=${PRESET:-benchmarks/results/presets/sd-base-layernorm.toml}
( export FASTTRAIN_CACHE=/tmp/ftcache0
  timeout 320 python3 -m fasttrain train "$W" --size base --steps 2 --warmup 1 --recipe "$P" \
    > "$OUT/warm-ours.out" 2>&1 &
  timeout 320 python3 -m fasttrain.peers "$W" --size base --steps 2 --warmup 1 \
    > "$OUT/warm-peer.out" 2>&1 &
  wait )
echo "both sides compiled after $(( $(date +%s) - LANE_END + LANE_BUDGET )) s"
lane 0 0-15 "python3 -m fasttrain ladder $W --size base --out $OUT/gpu0 --warmup 3 --rungs ${RUNGS:-none} --recipe $P --peer"
finish_lanes
grep -v '^USDT' "$OUT/lanes.log" | grep '^== \|^│\|rows:\|rror\|best fasttrain\|warning: the ratio' | tail -c 6000
