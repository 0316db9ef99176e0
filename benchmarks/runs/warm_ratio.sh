#!/usr/bin/env bash
# One GPU, two calls on the same warm machine: a preset's ratio to the peer confirmed where the
# four cold compiles (ours, peer, peer, ours) do not fit one ten-minute call (SD: the peer
# compiles the whole pipeline, about four minutes). MODE=prime measures each side once
# (--no-confirm), which also fills this machine's Inductor and Triton caches; MODE=confirm, the
# next call, runs the ladder's confirmation (ours, peer, peer, ours, and a third run of a side
# not yet steady) with those caches warm. A cache changes the compile time, not the step: both
# sides read the same caches. MODE=confirm on a cold machine stops at once rather than running
# past the call's limit.
#   MODE=prime WORKLOAD=diffusers:sd-v1 PRESET=benchmarks/results/presets/diffusers-sd-base.toml \
#     bash benchmarks/runs/warm_ratio.sh
LANE_BUDGET=${LANE_BUDGET:-575}
. "$(dirname "$0")/lanes.sh"
: "${WORKLOAD:?WORKLOAD=NAME}" "${PRESET:?PRESET=FILE}" "${MODE:?MODE=prime|confirm}"
export TORCHINDUCTOR_CACHE_DIR=/tmp/warm-ratio-inductor TRITON_CACHE_DIR=/tmp/warm-ratio-triton
ladder="python3 -m fasttrain ladder $WORKLOAD --size base --warmup 3 --recipe $PRESET --rungs none --peer"
case $MODE in
  prime) lane 0 0-15 "$ladder --no-confirm --out $OUT/prime" ;;
  confirm)
    [ -n "$(ls -A "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null)" ] \
      || { echo "cold machine: no Inductor cache from MODE=prime here; nothing run"; exit 3; }
    du -sh "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
    lane 0 0-15 "$ladder --out $OUT/confirm" ;;
  *) echo "MODE=$MODE: use prime or confirm"; exit 2 ;;
esac
finish_lanes
show_lanes confirm
