#!/bin/bash
# The FP8 KV cache's GPU checks and measurements in one call (see docs/performance.md, "FP8 KV
# cache"): its GPU tests, the attention micro-benchmark with bf16 and FP8 caches, the KV capacity of
# a Llama-3.1-8B-shaped engine with each, and the bf16 kernel tests touched by the change. Writes
# logs and JSON under $OUT.
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout 170 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kv_fp8.py -rA -s \
    > "$OUT/tests_fp8.log" 2>&1
echo "fp8 tests rc=$?" >> "$OUT/tests_fp8.log"
timeout 90 python -m bench.attention_micro --out "$OUT" --kv-dtypes auto,fp8 --batches 1,64 \
    --contexts 4096,8192 --fused-merge 1 --no-reference > "$OUT/attention_micro.log" 2>&1
echo "attention_micro rc=$?" >> "$OUT/attention_micro.log"
timeout 150 python -m bench.kv_capacity --out "$OUT" --config llama-3.1-8b.json \
    > "$OUT/kv_capacity.log" 2>&1
echo "kv_capacity rc=$?" >> "$OUT/kv_capacity.log"
timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/test_attention_triton.py \
    -k "mixed_batch_bf16 or split_kv or cuda_graph or padded" >> "$OUT/tests_fp8.log" 2>&1
echo "bf16 kernel tests rc=$?" >> "$OUT/tests_fp8.log"
