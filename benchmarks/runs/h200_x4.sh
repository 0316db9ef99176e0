#!/usr/bin/env bash
# All four ladders with their peers in one call on a 4 x H200 machine: one lane per GPU, each
# lane pinned to its own 16 cores, so the 10-minute command limit holds the whole measurement.
# Rows land in $OUT/*.jsonl, the lanes' logs in $OUT/lanes.log.
. "$(dirname "$0")/lanes.sh"
L="python3 -m fasttrain ladder --out $OUT --rung-timeout 420"
lane 0 0-15  "$L sd --size base --warmup 3 --rungs default"
lane 1 16-31 "$L swin --size base --peer" "python3 -m pytest -q -m gpu tests/"
lane 2 32-47 "$L llama --size base --peer"
lane 3 48-63 "$L vit --size base --peer" "$L sd --size base --rungs none --peer --warmup 3"
finish_lanes
tail -c 6000 "$OUT/lanes.log"
