#!/usr/bin/env bash
# One GPU: `fasttrain train` runs of named variants in a mirrored order (ORDER="A B C C B A"),
# after the gpu-marked tests that GPU_TESTS (a pytest -k expression) selects. A variant TAG is
# the environment variable V_TAG: what goes before and after $TRAIN_CMD, split at '::'
# (an older source: PYTHONPATH and its own Inductor cache before it; the workload, preset and
# --set switches after it). Each run's output is $OUT/run-N-TAG.out; the rows land in
# $OUT/train-*.jsonl in run order (train_rows.py), and the script prints one line per run.
#   git archive 3046b73 src | tar -x -C out/old
#   V_O="PYTHONPATH=out/old/src:/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-old::hf:llama \
#     --recipe P.toml" V_N="::hf:llama --recipe P.toml" ORDER="O N N O" \
#     bash benchmarks/runs/variants_ab.sh
LANE_BUDGET=${LANE_BUDGET:-585}
. "$(dirname "$0")/lanes.sh"
cmds=()
add_gpu_tests
i=0
for tag in ${ORDER:?ORDER names the variants to run, in order}; do
  var="V_$tag"
  spec=${!var:?$var is not set}
  before=${spec%%::*}; after=${spec#*::}
  cmds+=("FASTTRAIN_GIT_SHA=${SHA:-new} $before $TRAIN_CMD $after > $OUT/run-$((i++))-$tag.out 2>&1")
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep -v '^USDT' "$OUT/lanes.log" | grep "^== \|passed\|failed\|^E \|FAILED" | tail -c 5000
for f in "$OUT"/run-*.out; do echo "$(basename "$f"): $(grep -c . "$f") lines"; done
python3 benchmarks/runs/train_rows.py "$OUT"
