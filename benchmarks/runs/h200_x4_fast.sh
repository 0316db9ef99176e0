#!/usr/bin/env bash
# The fast preset search for the four workloads on a 4 x H200 machine, one lane each, every
# search with the peer in the same run on the same GPU. Not run: the same searches ran one after
# another on one H200 with h200_fast_1gpu.sh (rows ladder-*-20261121-05*/06*).
. "$(dirname "$0")/lanes.sh"
L="python3 -m fasttrain ladder --out $OUT --warmup 3 --rungs fast --peer --size base"
lane 0 0-15 "$L sd"
lane 1 16-31 "$L llama"
lane 2 32-47 "$L swin"
lane 3 48-63 "$L vit"
finish_lanes
( cd "$OUT" && find . -name '*.jsonl' -o -name '*.toml' | tar czf rows.tgz -T - \
  && find . -mindepth 1 ! -name rows.tgz ! -name lanes.log -delete )
grep -v '^USDT' "$OUT/lanes.log" | grep '^== \|^│\|fast preset\|rows:' | tail -c 9000
