#!/bin/bash
# Where the device time goes at 64 concurrent clients on the conv trace (issue 15, "throughput
# under load"), in one call: `python -m bench.serving_profile` on a Llama-3.1-8B-shaped engine with
# random weights made on the device, each scheme of $SCHEMES in its own process: bf16, fp8 (FP8
# weights), fp8kv (FP8 weights and KV cache), bf16kv (FP8 KV cache); bf16 then fp8 by default.
# Extra arguments go to every run (e.g. --max-num-batched-tokens 2048). Writes under $OUT.
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
for q in ${SCHEMES:-bf16 fp8}; do
    case "$q" in
        bf16) quant=() ;;
        fp8) quant=(--quantization fp8) ;;
        fp8kv) quant=(--quantization fp8 --kv-cache-dtype fp8) ;;
        bf16kv) quant=(--kv-cache-dtype fp8) ;;
        *) echo "SCHEMES: unknown scheme $q (bf16, fp8, fp8kv, bf16kv)"; exit 2 ;;
    esac
    timeout "${RUN_TIMEOUT:-200}" python -m bench.serving_profile --load-format dummy \
        --dump-stacks-after "$(( ${RUN_TIMEOUT:-200} - 15 ))" \
        --warmup-requests 64 --online-warmup 3 --online-seconds "${SECONDS_PER_RUN:-10}" \
        --out "$OUT/$q${TAG:-}" "${quant[@]}" "$@" > "$OUT/$q${TAG:-}.log" 2>&1
    echo "rc=$?" >> "$OUT/$q${TAG:-}.log"
    tail -45 "$OUT/$q${TAG:-}.log"
done
