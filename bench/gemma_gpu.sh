#!/bin/bash
# Gemma's fused kernels on a GPU, in one call: their GPU tests (the (1 + w) norm, the GELU gate and
# the RoPE kernel's q/k norm against transformers' Gemma 3 layers; the one-row GEMV at
# Gemma-3-27B's shapes; Gemma 2 and 3 on CUDA against transformers, and their piecewise graphs),
# then batch-1 decode of Gemma-3-27B beside Llama-3.1-8B against their rooflines (python -m
# bench.family_decode); with
# BASE_TREE (another checkout, e.g. the commit before the fused kernels, 2cf69ba) the same decode
# of it first, for a before-and-after on one machine. Writes under $OUT.
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -m gpu tests/test_layers_triton.py \
    tests/test_row_gemv.py -k "gemma or Gemma" > "$OUT/gpu-tests.log" 2>&1
echo "kernel tests rc=$?" >> "$OUT/gpu-tests.log"
timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -m gpu tests/test_model_parity.py \
    tests/test_piecewise_graphs.py -k "gemma" >> "$OUT/gpu-tests.log" 2>&1
echo "parity tests rc=$?" >> "$OUT/gpu-tests.log"
tail -4 "$OUT/gpu-tests.log"
CONFIGS=${CONFIGS:-llama-3.1-8b.json,gemma-3-27b-it.json}
if [ -n "${BASE_TREE:-}" ]; then
    mkdir -p "$OUT/base"
    (cd "$BASE_TREE" && timeout "${DECODE_TIMEOUT:-240}" python -m bench.family_decode \
        --configs "$CONFIGS" --out "$OUT/base") > "$OUT/base/log" 2>&1
    echo "base rc=$?" >> "$OUT/base/log"
    tail -5 "$OUT/base/log"
fi
timeout "${DECODE_TIMEOUT:-240}" python -m bench.family_decode --configs "$CONFIGS" \
    --out "$OUT" > "$OUT/decode.log" 2>&1
echo "family_decode rc=$?" >> "$OUT/decode.log"
tail -5 "$OUT/decode.log"
