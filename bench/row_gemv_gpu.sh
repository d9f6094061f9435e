#!/bin/bash
# Batch-1 decode with the norm and activation prologues fused into the one-row linears
# (engine/layers/row_gemv.py), in one call: the kernel and its tile sweep (bench/row_gemv.py), then
# batch-1 decode of the Llama-3.1-8B-shaped model, bf16 and FP8, with the fusion off, then on
# (bench/fp8_decode.py --prologues off,on, the sweep's best tiles). Writes under $OUT.
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout 240 python -m bench.row_gemv --out "$OUT" > "$OUT/row_gemv.log" 2>&1
echo "row_gemv rc=$?" >> "$OUT/row_gemv.log"
tail -12 "$OUT/row_gemv.log"
tiles=()
[ -f "$OUT/row_gemv.json" ] && tiles=(--row-tiles "$OUT/row_gemv.json")
timeout "${DECODE_TIMEOUT:-400}" python -m bench.fp8_decode --prologues off,on "${tiles[@]}" \
    --out "$OUT" > "$OUT/fp8_decode.log" 2>&1
echo "fp8_decode rc=$?" >> "$OUT/fp8_decode.log"
tail -12 "$OUT/fp8_decode.log"
