# Sourced by the multi-GPU scripts: environment, peer wheels, and `lane GPU CORES COMMAND...`,
# which runs commands one after another on one GPU pinned to its cores, logging to
# /tmp/laneGPU.log; `finish_lanes` waits and gathers the logs into $OUT/lanes.log. Every lane
# stops at the same deadline, LANE_BUDGET seconds (default 540) after this file is sourced: a
# command still running then is stopped (its finished rows stay), later ones are skipped.
set -u
LANE_END=$(( $(date +%s) + ${LANE_BUDGET:-540} ))
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peerwheels/*.whl \
  && export PYTHONPATH=src:/tmp/site
OUT=${OUT:-out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,temperature.gpu --format=csv,noheader
lane() {  # lane GPU CORES COMMAND...
  local gpu=$1 cores=$2; shift 2
  ( export CUDA_VISIBLE_DEVICES=$gpu FASTTRAIN_CACHE=/tmp/ftcache$gpu
    for cmd in "$@"; do
      left=$(( LANE_END - $(date +%s) ))
      if [ "$left" -le 10 ]; then echo "== gpu$gpu: skipped, no time left: $cmd"; continue; fi
      echo "== gpu$gpu ($left s left): $cmd"
      timeout -k 15 "$left" taskset -c "$cores" bash -c "$cmd" || echo "== gpu$gpu: exit $?"
    done
  ) > "/tmp/lane$gpu.log" 2>&1 &
}
finish_lanes() {
  wait
  for g in 0 1 2 3 4 5 6 7; do [ -f /tmp/lane$g.log ] && grep -v '^USDT' /tmp/lane$g.log; done \
    > "$OUT/lanes.log"
}
# What a two-GPU script prints at its end: the lanes' commands, tables, rows files, errors,
# ratio lines and test counts from $OUT/lanes.log (Kineto's lines are already out), plus the
# lines that the extra grep pattern $1 (alternatives joined by \|) matches.
show_lanes() {
  grep "^== \|^│\|rows:\|rror\|best fasttrain\|warning: the ratio\|passed\|failed${1:+\|$1}" \
    "$OUT/lanes.log" | tail -c 9000
}
# The own-model scripts' ladder of examples/MODEL.py: the fp32 parity base, the recipe FILE
# (with any --set arguments after it), then ours, peer, peer, ours against the plain loop.
#   own_ladder MODEL OUT FILE [--set KEY=VALUE ...]
own_ladder() {
  local model=$1 out=$2; shift 2
  echo "python3 -m fasttrain ladder examples.$model:make_workload --size base --warmup 3 --rungs fp32 --recipe $* --peer --out $out"
}
# Shared by the single-GPU A/B scripts: their `fasttrain train` command, and the gpu-marked tests
# that a pytest -k expression in GPU_TESTS selects, appended to the caller's cmds when set.
TRAIN_CMD="python3 -m fasttrain train --size base --steps 30 --warmup 5"
add_gpu_tests() {
  [ -n "${GPU_TESTS:-}" ] && cmds+=("python3 -m pytest -q -m gpu tests/ -k '$GPU_TESTS' --tb=short 2>&1 | grep -v Warning | tail -40")
  true
}
# The same tests as one lane command (the two-GPU scripts): the full log in $OUT/gpu-tests-full.txt,
# the failures and the count in $OUT/gpu-tests.txt.
gpu_tests_to_out() {
  echo "python3 -m pytest -q -m gpu tests/ -k '$GPU_TESTS' --tb=short -p no:cacheprovider 2>&1 | grep -v '^DEBUG' > $OUT/gpu-tests-full.txt; grep -E '^E |^(FAILED|PASSED|ERROR)|passed|failed' $OUT/gpu-tests-full.txt | tail -60 | tee $OUT/gpu-tests.txt"
}
