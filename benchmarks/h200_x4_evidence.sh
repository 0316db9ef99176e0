#!/usr/bin/env bash
# Next 4 x H200 call: lane 0 the SD ladder (about 9 of the 10 minutes); lane 1 the SD peer in
# the same call, then the ViT ladder with its peer (the cuda-graphs rung, now without the batch
# prefetch under graphs) and the GPU tests; lane 2 the profile evidence; lane 3 the memory
# evidence. Each lane pinned to its 16 cores. Rows under $OUT, lane logs in $OUT/lanes.log.
. "$(dirname "$0")/lanes.sh"
L="python3 -m fasttrain ladder --out $OUT --rung-timeout 420"
lane 0 0-15  "$L sd --size base --warmup 3"
lane 1 16-31 "$L sd --size base --rungs none --peer --warmup 3" "$L vit --size base --peer" \
  "python3 -m pytest -q -m gpu tests/test_gpu.py"
lane 2 32-47 "bash benchmarks/h200_profile.sh"
lane 3 48-63 "bash benchmarks/h200_memory.sh"
finish_lanes
# At most 8 files come back: rows and suggested recipes in one archive, traces in another.
( cd "$OUT" && find . -name '*.jsonl' -o -name '*.toml' | tar czf rows.tgz -T - \
  && find . -name '*.json.gz' | tar cf traces.tar -T - \
  && find . -mindepth 1 ! -name rows.tgz ! -name traces.tar ! -name lanes.log -delete )
tail -c 6000 "$OUT/lanes.log"
