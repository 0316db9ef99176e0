#!/usr/bin/env bash
# One GPU, models of your own (examples/MODEL.py, unchanged code) against the plain loop a user
# writes, one after another within LANE_BUDGET seconds: for each JOB in JOBS, "ladder:MODEL" runs
# the workload through the ladder (fp32 parity base, examples/recipes/fast.toml, then ours,
# peer, peer, ours against the plain loop) and "step:MODEL" runs benchmarks/runs/step_vs_loop.py
# (plain, Step, Step, plain). "export:WORKLOAD:SIZE:RUNG" runs benchmarks/runs/export_check.py.
#   JOBS='ladder:gpt step:gpt ladder:vit' bash benchmarks/runs/own_model_1gpu.sh
. "$(dirname "$0")/lanes.sh"
: "${JOBS:?JOBS='ladder:MODEL step:MODEL export:WORKLOAD:SIZE:RUNG ...'}"
export PYTHONPATH="$PYTHONPATH:."
cmds=()
for job in $JOBS; do
  IFS=':' read -ra p <<< "$job"
  case ${p[0]} in
    ladder) cmds+=("$(own_ladder "${p[1]}" "$OUT/ladder-${p[1]}" examples/recipes/fast.toml)") ;;
    step) cmds+=("python3 benchmarks/runs/step_vs_loop.py --model ${p[1]} --size base --out $OUT/step-vs-loop-${p[1]}.jsonl") ;;
    export) cmds+=("python3 benchmarks/runs/export_check.py ${p[1]} ${p[2]} ${p[3]} cuda 2>&1 | tail -60") ;;
    *) echo "unknown job $job (ladder:MODEL, step:MODEL, export:WORKLOAD:SIZE:RUNG)"; exit 2 ;;
  esac
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
show_lanes '^plain\|^step\|x the plain\|^env\|^package\|rc \|Fatal\|Segmentation\|File "'
