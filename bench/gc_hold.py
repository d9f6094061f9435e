"""What holding Python's cyclic GC through the start (warmup.start.hold_gc) leaves behind: the start
sequence in a fresh process, with the hold and without it, in turn.

`python -m bench.gc_hold --model DIR [--rounds 3]` (a GPU; DIR a checkpoint whose pack a first
start has written) prints, for each start: seconds to ready, the KV blocks sized, the objects frozen
at ready, then what a full collection finds among them (objects, seconds, and the GPU memory it
frees). Cyclic garbage that held GPU memory would shrink the KV cache and stay frozen; this shows
whether any does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from bench.cold_start import child_env

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import gc, sys, time
import warmup.start as start
if sys.argv[1] == "without":
    start.hold_gc = lambda: None
t0 = time.perf_counter()
engine = start.EngineStart(start.StartArgs(
    model=sys.argv[2], cache_dir=sys.argv[3], device="cuda",
    engine_options={"max_model_len": 4096},
)).begin().future.result()
ready = time.perf_counter() - t0
import torch
torch.cuda.synchronize()
before, frozen = torch.cuda.memory_allocated(), gc.get_freeze_count()
gc.unfreeze()
t0 = time.perf_counter()
found = gc.collect()
seconds = time.perf_counter() - t0
freed = before - torch.cuda.memory_allocated()
print(f"{sys.argv[1]:<8} ready {ready:5.2f} s  KV blocks {engine.engine.runner.num_blocks}  "
      f"frozen {frozen}  garbage {found} objects, collected in {seconds:.3f} s, "
      f"GPU bytes freed {freed}", flush=True)
engine.shutdown()
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache-dir", default=None, help="default: the model's parent/cache")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cache_dir = args.cache_dir or os.path.join(os.path.dirname(args.model), "cache")
    env = child_env()
    for _ in range(args.rounds):
        for mode in ("with", "without"):
            subprocess.run(
                [sys.executable, "-c", _CHILD, mode, args.model, cache_dir],
                cwd=REPO,
                env=env,
                check=True,
                timeout=300,
            )


if __name__ == "__main__":
    main()
