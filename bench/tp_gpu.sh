#!/usr/bin/env bash
# The tensor-parallel measurements in one call on a 2-GPU machine (nvidia-h200-x2): each part of
# bench/tp.py runs in its own process under its own time limit and within one overall budget, writes
# $OUT/tp-<part>.json as it finishes (a part that fails or runs out of time leaves the others'
# results); the parts' logs are kept apart and their tails end up in $OUT/tp-logs.txt (the device
# tool returns at most 8 files).
# Usage: OUT=dir [TP_BUDGET_S=470] bash bench/tp_gpu.sh
set -u
OUT=${OUT:-/tmp/coldbrew-tp}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off (the machine's notes require it; set again in case the environment
# lost them).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
DEADLINE=$(( $(date +%s) + ${TP_BUDGET_S:-470} ))

run() {  # run PART LIMIT_S [args]: skipped when less than 30 s of the budget is left
  local part=$1 limit=$2 left rc
  shift 2
  left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "== $part: skipped ($left s of the budget left)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  timeout -k 15 "$limit" "$PY" -m bench.tp "$part" --out "$OUT" "$@" > "$LOGS/$part.log" 2>&1
  rc=$?
  echo "== $part: exit $rc after $(( $(date +%s) - t0 )) s (limit $limit s)"
  [ "$rc" -ne 0 ] && tail -n 25 "$LOGS/$part.log"
  { echo "== $part (exit $rc)"; tail -n 60 "$LOGS/$part.log"; } >> "$OUT/tp-logs.txt"
}

run env 40
run allreduce 90
run parity 170
run serve70b 240 --online-seconds 30
run symm70b 120
"$PY" -m bench.tp report --out "$OUT"
