#!/bin/bash
# Batch-1 decode with the kernels' programmatic dependent launch (engine/pdl.py) off, then on, in one
# call: bench/fp8_decode.py --pdl off,on (Llama-3.1-8B-shaped, bf16 with the fused prologues, and
# FP8) at a 128-token prompt and at a 3,072-token one; with BASE_TREE (another checkout, e.g. the
# commit before) the same benchmark of it first, for a before-and-after on one machine. Writes
# under $OUT (bench/results/2026-11-27-h100-pdl/ holds runs of it).
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
if [ -n "${BASE_TREE:-}" ]; then
    mkdir -p "$OUT/base"
    (cd "$BASE_TREE" && timeout "${BASE_TIMEOUT:-120}" python -m bench.fp8_decode \
        --out "$OUT/base") > "$OUT/base/log" 2>&1
    echo "base rc=$?" >> "$OUT/base/log"
    tail -5 "$OUT/base/log"
fi
for prompt in 128 3072; do
    mkdir -p "$OUT/prompt-$prompt"
    timeout "${DECODE_TIMEOUT:-150}" python -m bench.fp8_decode --pdl off,on \
        --prompt-len "$prompt" --out "$OUT/prompt-$prompt" > "$OUT/prompt-$prompt/log" 2>&1
    echo "fp8_decode rc=$?" >> "$OUT/prompt-$prompt/log"
    tail -7 "$OUT/prompt-$prompt/log"
done
