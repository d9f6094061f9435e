#!/bin/bash
# Sourced by the GPU scripts before they time a start: every module's bytecode compiled, as in the
# image (pip compiles what it installs; the Dockerfile compiles the project). The device machines'
# torch comes without .pyc files and their Python runs with PYTHONDONTWRITEBYTECODE=1, so every
# start there compiles torch from source (about 1.5 s of a 3.4 s `import torch`): the site-packages
# holding torch, this checkout and PYTHONPATH's folders are compiled first (into
# PYTHONPYCACHEPREFIX where torch's folder is read-only). Prints bare `import torch` + CUDA init
# before and after, and appends it to $OUT/bytecode.txt.
bare_torch() {
    for _ in 1 2 3; do
        python -c "import time; t = time.perf_counter(); import torch; torch.cuda.init(); \
print(round(time.perf_counter() - t, 2))"
    done | tr '\n' ' '
}
mkdir -p "${OUT:-bench-out}"
echo "bare torch + CUDA init (s), bytecode as found: $(bare_torch)" | tee -a "${OUT:-bench-out}/bytecode.txt"
SITE=$(python -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
if [ ! -w "$SITE" ]; then
    export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/coldbrew-pyc}
fi
t0=$(date +%s)
# shellcheck disable=SC2086 - PYTHONPATH's folders as separate arguments
python -m compileall -q -j 0 "$SITE" . ${PYTHONPATH//:/ } > /dev/null 2>&1
echo "compiled in $(($(date +%s) - t0)) s (PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-unset}):" \
    "$(bare_torch)" | tee -a "${OUT:-bench-out}/bytecode.txt"
