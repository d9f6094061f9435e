#!/bin/bash
# Cold start of `python -m handler serve` with the FP8 pack beside the bf16 one, in one call
# (docs/performance.md, "FP8 under load"): the bf16 run first (it synthesizes the checkpoint), its
# pack removed, then QUANTIZATION=fp8 (its first start writes the FP8 pack). Writes under $OUT.
set -u
OUT=${OUT:-bench-out}
MODEL=${MODEL:-/tmp/coldbrew-bench/model}
RUNS="--entries serve --warm-runs ${WARM_RUNS:-3} --dropped-runs 1 --hf-runs 0 --import-repeats 0"
mkdir -p "$OUT"
timeout 240 python -m bench.cold_start --model-dir "$MODEL" --out "$OUT/bf16" $RUNS \
    > "$OUT/bf16.log" 2>&1
echo "rc=$?" >> "$OUT/bf16.log"
rm -f "$MODEL"/packs/*-bfloat16-v*.cbpack
timeout 200 python -m bench.cold_start --model-dir "$MODEL" --out "$OUT/fp8" $RUNS \
    --env QUANTIZATION=fp8 > "$OUT/fp8.log" 2>&1
echo "rc=$?" >> "$OUT/fp8.log"
