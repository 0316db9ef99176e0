#!/usr/bin/env bash
# Two GPUs, a model of your own (examples/MODEL.py, unchanged code) against the plain loop a
# user writes. GPU 0: fasttrain.Step's recipes one after another (benchmarks/runs/step_vs_loop.py
# --no-repeats: plain, then each of STEP_RECIPES, JSON switches over Step's default, separated
# by ';'), then the gpu-marked tests that GPU_TESTS (a pytest -k expression) selects. GPU 1: the
# workload through the ladder for each recipe in LADDER ("FILE[+KEY=VALUE[+KEY=VALUE...]]"
# separated by spaces; the fp32 parity base, the recipe, then ours, peer, peer, ours against the
# plain loop). A --set applies to the fp32 base rung too, so a switch that needs bf16
# (stream_dtype) belongs in the recipe file instead.
#   MODEL=vit STEP_RECIPES='{};{"kernels": "gelu,attention,patch,layernorm"}' \
#     LADDER='examples/recipes/fast.toml' bash benchmarks/runs/own_model_x2.sh
. "$(dirname "$0")/lanes.sh"
: "${MODEL:?MODEL=vit|gpt|cnn}"
export PYTHONPATH="$PYTHONPATH:."
first=()
IFS=';' read -ra recipes <<< "${STEP_RECIPES:-{\}}"
args=""
for r in "${recipes[@]}"; do args+=" --recipe '$r'"; done
first+=("python3 benchmarks/runs/step_vs_loop.py --model $MODEL --size base --no-repeats --out $OUT/step-explore-$MODEL.jsonl $args")
[ -n "${GPU_TESTS:-}" ] && first+=("$(gpu_tests_to_out)")
second=()
k=0
for l in ${LADDER:-examples/recipes/fast.toml}; do
  IFS='+' read -ra parts <<< "$l"; file=${parts[0]}; sets=""
  for s in "${parts[@]:1}"; do sets+=" --set $s"; done
  second+=("$(own_ladder "$MODEL" "$OUT/ladder-$k" "$file$sets")")
  k=$((k + 1))
done
lane 0 0-15 "${first[@]}"
lane 1 16-31 "${second[@]}"
finish_lanes
show_lanes '^plain\|^step\|x the plain'
