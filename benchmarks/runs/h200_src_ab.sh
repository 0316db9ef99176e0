#!/usr/bin/env bash
# One H200: `fasttrain train` of the working tree against an older copy of its src/ (OLD_SRC,
# e.g. `git archive OLD src | tar -x -C out/old`), runs new, old, old, new, with the same
# WORKLOAD and PRESET, their git_sha set from NEW_SHA and OLD_SHA. Both sides (and the GPU
# tests of GPU_TESTS, a pytest -k expression) compile once side by side first, so the four
# measured runs start from warm Inductor caches. The rows land in $OUT/train-WORKLOAD.jsonl.
# PROBE=1: the side-by-side compile is each side's copy probe (copy_probe.py, rows in
# $OUT/copy-probe-{old,new}.jsonl) instead of two short training runs. OLD_PRESET: the old
# side's preset, where it differs (two presets on one source: OLD_SRC=src). The old side keeps
# its own Inductor cache: the AOT cache is keyed on the forward graph, so a custom op whose
# backward changed (same forward) would otherwise reuse the other side's compiled backward.
#   OLD_SRC=out/old/src OLD_SHA=34e962a NEW_SHA=bd32fe7 bash benchmarks/runs/h200_src_ab.sh
#   OLD_SRC=src OLD_PRESET=benchmarks/results/presets/sd-base-layernorm.toml \
#     PRESET=benchmarks/results/presets/sd-base-conv.toml bash benchmarks/runs/h200_src_ab.sh
LANE_BUDGET=${LANE_BUDGET:-585}
. "$(dirname "$0")/lanes.sh"
W=${WORKLOAD:-sd}
P=${PRESET:-benchmarks/results/presets/sd-base-layernorm.toml}
PO=${OLD_PRESET:-$P}
OLD_SRC=${OLD_SRC:-out/old/src}
WARM="python3 -m fasttrain train $W --size base --steps 2 --warmup 1 --recipe"
( export FASTTRAIN_CACHE=/tmp/ftcache0
  [ -n "${GPU_TESTS:-}" ] && timeout 330 python3 -m pytest -q -m gpu tests/ \
    -k "$GPU_TESTS" --tb=short > "$OUT/gpu-tests.txt" 2>&1 &
  if [ -n "${PROBE:-}" ]; then
    TAG=old FASTTRAIN_GIT_SHA=${OLD_SHA:-old} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-old \
      PYTHONPATH=$OLD_SRC timeout 340 \
      python3 benchmarks/probes/copy_probe.py "$W" "$PO" > "$OUT/probe-old.out" 2>&1 &
    TAG=new FASTTRAIN_GIT_SHA=${NEW_SHA:-new} timeout 340 \
      python3 benchmarks/probes/copy_probe.py "$W" "$P" > "$OUT/probe-new.out" 2>&1 &
  else
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-old PYTHONPATH=$OLD_SRC timeout 330 $WARM "$PO" \
      > "$OUT/warm-old.out" 2>&1 &
    timeout 330 $WARM "$P" > "$OUT/warm-new.out" 2>&1 &
  fi
  wait )
echo "compiled after $(( $(date +%s) - LANE_END + LANE_BUDGET )) s"
[ -n "${GPU_TESTS:-}" ] && tail -3 "$OUT/gpu-tests.txt"
NEW="FASTTRAIN_GIT_SHA=${NEW_SHA:-new} $TRAIN_CMD $W --recipe $P"
OLD="FASTTRAIN_GIT_SHA=${OLD_SHA:-old} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-old PYTHONPATH=$OLD_SRC $TRAIN_CMD $W --recipe $PO"
lane 0 0-15 "$NEW > $OUT/run-0-$W.out" "$OLD > $OUT/run-1-$W.out" \
  "$OLD > $OUT/run-2-$W.out" "$NEW > $OUT/run-3-$W.out"
finish_lanes
grep '^==' "$OUT/lanes.log"
python3 benchmarks/runs/train_rows.py "$OUT"
