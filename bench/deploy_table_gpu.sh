#!/bin/bash
# The README's cold-start table in one call (python -m bench.cold_start): the three entry points
# (`python -m handler serve`; `python -m handler` taking its job from the job queue's stand-in and
# behind the SDK's local API), page cache warm and dropped, beside bare `import torch` + CUDA init
# and HF transformers, with every module's bytecode compiled as in the image (pip compiles what it
# installs; the Dockerfile compiles the project; bench/bytecode.sh). The entry points' own
# dependencies are expected on PYTHONPATH (carried wheels).
# Writes under $OUT.
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
# shellcheck source=bench/bytecode.sh
source "$(dirname "$0")/bytecode.sh"
timeout "${TABLE_TIMEOUT:-480}" python -m bench.cold_start --warm-runs "${WARM_RUNS:-5}" \
    --dropped-runs "${DROPPED_RUNS:-2}" --hf-runs "${HF_RUNS:-1}" --logs --out "$OUT/table" \
    > "$OUT/table.log" 2>&1
echo "cold_start rc=$?" >> "$OUT/table.log"
tail -3 "$OUT/table.log"
