#!/usr/bin/env bash
# One 4 x H200 call for issues 2-4, each lane pinned to one GPU and its 16 cores, all stopping at
# the lanes' deadline (lanes.sh).
#   lane 0: SD fp32 (the parity base), compile, CUDA graphs and the diffusers/transformers peer in
#           one run on one GPU; the llama advisor baseline.
#   lane 1: fit sd and llama with the fast eager recipe.
#   lane 2: the ViT-L/16 memory ladder at batch 256; fit swin.
#   lane 3: the ViT-B ladder with its peer; fit vit; the GPU tests.
# Rows under $OUT, lane logs in $OUT/lanes.log. (The first call of this script, at 63417d3,
# had lanes for the SD profiles, the suggested recipe and the first fits.)
. "$(dirname "$0")/lanes.sh"
L="python3 -m fasttrain ladder --out $OUT --warmup 3"
P="python3 -m fasttrain profile --out $OUT --steps 10"
FIT="python3 -m fasttrain fit --size base --out $OUT --set precision=bf16-mixed \
  --set optimizer_impl=fused --set attention=auto --set workers=12 --set pin_memory=true \
  --set non_blocking=true --set device_prefetch=true"
lane 0 0-15 "$L sd --size base --from compile --peer" \
  "$P llama --size base --set precision=tf32 --steps 6"
lane 1 16-31 "$FIT sd --set ema=side-stream --set channels_last=true --multiple-of 8" "$FIT llama"
lane 2 32-47 "$L vit --size large --rungs memory --batch 256" "$FIT swin --multiple-of 8"
lane 3 48-63 "$L vit --size base --peer" "$FIT vit --multiple-of 8" \
  "python3 -m pytest -q -m gpu tests/"
finish_lanes
# At most 8 files come back: rows and suggested recipes in one archive, traces in another.
( cd "$OUT" && find . -name '*.jsonl' -o -name '*.toml' | tar czf rows.tgz -T - \
  && find . -name '*.json.gz' | tar cf traces.tar -T - \
  && find . -mindepth 1 ! -name rows.tgz ! -name traces.tar ! -name lanes.log -delete )
grep -v '^USDT' "$OUT/lanes.log" | grep '^== \|answer\|^│\|rows:\|passed\|failed' | tail -c 9000
