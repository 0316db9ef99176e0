#!/usr/bin/env bash
# Two GPUs, one preset of a public-model workload, both of its checks at once: GPU 0 runs the
# ladder's fp32 rung of the unconverted public model and then the preset (the preset's parity
# against that base), GPU 1 the preset and the ratio's confirmation against the peer (the preset,
# the peer, the peer again, the preset again, and a third run of a side not yet confirmed), each
# lane pinned to its own 16 cores. GPU_TESTS (a pytest -k expression) runs those gpu-marked tests
# on GPU 0 after its ladder; TRAIN="WORKLOAD=RECIPE ..." adds `fasttrain train` rows after that.
#   WORKLOAD=diffusers:sd-v1 PRESET=benchmarks/results/presets/diffusers-sd-base.toml \
#     GPU_TESTS='diffusers or sd_under' bash benchmarks/runs/parity_and_ratio_x2.sh
. "$(dirname "$0")/lanes.sh"
: "${WORKLOAD:?WORKLOAD=NAME}" "${PRESET:?PRESET=FILE}"
ladder="python3 -m fasttrain ladder $WORKLOAD --size base --warmup 3 --recipe $PRESET"
first=("$ladder --rungs fp32 --out $OUT/parity")
[ -n "${GPU_TESTS:-}" ] && first+=("$(gpu_tests_to_out)")
i=0
for p in ${TRAIN:-}; do
  first+=("$TRAIN_CMD ${p%%=*} --recipe ${p#*=} --out $OUT/train > $OUT/run-$((i++)).out")
done
lane 0 0-15 "${first[@]}"
lane 1 16-31 "$ladder --rungs none --peer --out $OUT/ratio"
finish_lanes
show_lanes
