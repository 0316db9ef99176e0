#!/usr/bin/env bash
# One 4 x H200 call for issues 2-4, each lane pinned to one GPU and its 16 cores, all stopping at
# the lanes' deadline (lanes.sh). Lane 1 is the SD comparison: fp32 (the parity base), compile,
# CUDA graphs and the diffusers/transformers peer in one run on one GPU. Lane 2 is the profile
# evidence; lanes 0 and 3 the memory evidence and the other advisor baselines.
# Rows under $OUT, lane logs in $OUT/lanes.log.
. "$(dirname "$0")/lanes.sh"
L="python3 -m fasttrain ladder --out $OUT --warmup 3"
P="python3 -m fasttrain profile --out $OUT --steps 10"
FIT="python3 -m fasttrain fit --size base --out $OUT --set precision=bf16-mixed \
  --set optimizer_impl=fused --set attention=auto"
lane 1 16-31 "$L sd --size base --from compile --peer"
lane 0 0-15 "$FIT sd --multiple-of 4" "$FIT llama" "$P llama --size base --set precision=tf32 --steps 6"
lane 2 32-47 \
  "$P sd --size base --set precision=tf32 --suggest-recipe $OUT/sd-suggested.toml" \
  "$L sd --size base --recipe $OUT/sd-suggested.toml" \
  "$P sd --size base --set precision=bf16-mixed --set optimizer_impl=fused --set attention=auto \
     --set workers=12 --set pin_memory=true --set non_blocking=true --set device_prefetch=true \
     --set ema=side-stream --set channels_last=true --set compile=regional" \
  "$P swin --size base --set precision=tf32 --steps 6"
lane 3 48-63 "$L vit --size large --rungs memory" "$FIT vit --multiple-of 8" \
  "$P vit --size base --set precision=tf32 --steps 6" "python3 -m pytest -q -m gpu tests/test_gpu.py"
finish_lanes
# At most 8 files come back: rows and suggested recipes in one archive, traces in another.
( cd "$OUT" && find . -name '*.jsonl' -o -name '*.toml' | tar czf rows.tgz -T - \
  && find . -name '*.json.gz' | tar cf traces.tar -T - \
  && find . -mindepth 1 ! -name rows.tgz ! -name traces.tar ! -name lanes.log -delete )
tail -c 7000 "$OUT/lanes.log"
