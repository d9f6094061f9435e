#!/bin/bash
# FP8 beside bf16 under load, in one call (docs/performance.md, "FP8 under load"): the merged FP8
# GPU checks (an FP8 checkpoint on the GPU, the engine with FP8 weights and with an FP8 KV cache),
# then online serving at concurrency 64 on the conv trace of a Llama-3.1-8B-shaped engine with
# random weights made on the device: bf16, FP8 weights, FP8 weights + FP8 KV. Writes under $OUT.
set -u
OUT=${OUT:-bench-out}
SECONDS_PER_LEVEL=${SECONDS_PER_LEVEL:-15}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_checkpoints.py \
    tests/test_fp8_gpu.py tests/test_kv_fp8.py -k "checkpoint or engine or graph" -rA \
    > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/tests.log"
run() {  # name, extra args
    local name=$1
    shift
    timeout 150 python -m bench.serving --parts online --concurrency "${CONCURRENCY:-64}" \
        --online-seconds "$SECONDS_PER_LEVEL" --online-warmup 3 --warmup-requests 64 \
        --load-format dummy --out "$OUT/serving-$name" "$@" > "$OUT/serving-$name.log" 2>&1
    echo "rc=$?" >> "$OUT/serving-$name.log"
}
run bf16
run fp8 --quantization fp8
run fp8-kv8 --quantization fp8 --kv-cache-dtype fp8
