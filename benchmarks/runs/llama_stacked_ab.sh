#!/usr/bin/env bash
# One GPU: the stacked projections (q, k, v and gate, up as one GEMM each) on hf:llama's bf16
# preset, A B C D D C B A with `fasttrain train` (30 steps after 5): A the projections separate
# (the class attributes off, benchmarks/runs/with_attrs.py), B stacked (the default), C stacked
# + master_weights, D C + pdl + combo_kernels. First the layer alone, compiled, both ways
# (kernels_micro.py --only stacked). Rows: $OUT/kernels-micro-stacked.jsonl,
# $OUT/train-hf_llama.jsonl in run order (train_rows.py).
#   FASTTRAIN_GIT_SHA=abc1234 bash benchmarks/runs/llama_stacked_ab.sh
LANE_BUDGET=${LANE_BUDGET:-585}
. "$(dirname "$0")/lanes.sh"
P=${PRESET:-src/fasttrain/presets/hf-llama-base-bf16.toml}
OFF="fasttrain.layers.mlp.SwiGLU.stacked=False fasttrain.converters.hf_llama.HFAttention.stacked=False"
timeout 200 python3 benchmarks/kernels/kernels_micro.py --only stacked \
  --out "$OUT/kernels-micro-stacked.jsonl" 2>&1 | grep -v Warning | tail -8
V=("$OFF --" "--" "-- --set master_weights=true"
   "-- --set master_weights=true --set pdl=true --set combo_kernels=true")
cmds=()
for i in 0 1 2 3 3 2 1 0; do
  read -r -a parts <<< "${V[i]}"
  attrs=() rest=()
  seen=0
  for p in "${parts[@]}"; do
    if [ "$p" = "--" ]; then seen=1; elif [ $seen = 0 ]; then attrs+=("$p"); else rest+=("$p"); fi
  done
  cmds+=("FASTTRAIN_GIT_SHA=${FASTTRAIN_GIT_SHA:-new} python3 benchmarks/runs/with_attrs.py ${attrs[*]} -- ${TRAIN_CMD#python3 -m fasttrain } hf:llama --recipe $P ${rest[*]} > $OUT/run-${#cmds[@]}-v$i.out 2>&1")
done
[ -n "${DRY:-}" ] && { printf "%s\n" "${cmds[@]}"; exit 0; }
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep '^==' "$OUT/lanes.log"
python3 benchmarks/runs/train_rows.py "$OUT"
