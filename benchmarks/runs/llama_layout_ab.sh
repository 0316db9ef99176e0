#!/usr/bin/env bash
# One H100: SDPA with q, k, v contiguous in (B, H, T, D) (HFAttention.contiguous_heads) against
# the transposed views, first alone (sdpa_layout_micro.py), then on hf:llama with the bf16
# master-weights preset, off on on off. Rows: $OUT/sdpa-layout.jsonl, $OUT/train-hf_llama.jsonl.
LANE_BUDGET=570
. benchmarks/runs/lanes.sh
timeout 120 python3 benchmarks/kernels/sdpa_layout_micro.py --out $OUT/sdpa-layout.jsonl 2>&1 | grep -v Warn | tail -4
P=benchmarks/results/presets/hf-llama-base-bf16-master-weights.toml
ON=fasttrain.converters.hf_llama.HFAttention.contiguous_heads=True
cmds=()
for v in off on on off; do
  a=""; [ $v = on ] && a=$ON
  cmds+=("FASTTRAIN_GIT_SHA=62a06d4+layout python3 benchmarks/runs/with_attrs.py $a -- ${TRAIN_CMD#python3 -m fasttrain } hf:llama --recipe $P > $OUT/run-${#cmds[@]}-$v.out 2>&1")
done
lane 0 0-15 "${cmds[@]}"
finish_lanes
grep '^==' $OUT/lanes.log | cut -c1-60
python3 benchmarks/runs/train_rows.py $OUT
