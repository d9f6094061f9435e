"""What runs beside `import torch` at start costs it: bare `import torch` + CUDA init in a fresh
process, alone and beside each thing the start runs at the same time in other processes.

`python -m bench.start_overlap --pack PATH [--runs 5]` times bench/cold_start_child.py's bare mode
(interpreter start -> torch imported -> CUDA initialised) under each condition, the conditions taken
in turn within each round so that drift hits them alike:

  alone              nothing else running
  stream T           the device stream of PATH (cache.device_stream, T reader threads) started
                     with the child, page cache warm
  sdk                a second interpreter importing the RunPod SDK (`import runpod`, with its CPU
                     probe), started with the child
  stream 16 + sdk    both
  GC off             alone, Python's cyclic GC off (as the start holds it)
  GC off ctx         the same with the GPU's primary context begun on a thread before `import torch`
                     (as the start does: cache.cuda_driver)
  GC off ctx stream 16
                     and the device stream beside it (the engine's process of `serve`)

Prints one table (median and spread per condition) and writes OUT/start_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.cold_start import child_env

REPO = Path(__file__).resolve().parent.parent
CHILD = REPO / "bench" / "cold_start_child.py"


def bare_child(mode: str = "bare") -> dict:
    """One bare child (bench/cold_start_child.py's `mode`): its import_torch and cuda_init stamps,
    seconds from its spawn."""
    spawned = time.time()
    out = subprocess.run(
        [sys.executable, str(CHILD), mode, "-", "1"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError((out.stderr or out.stdout)[-2000:])
    stamps = json.loads(line[len("RESULT ") :])["stamps"]
    return {k: v - spawned for k, v in stamps.items()}


def run_condition(name: str, pack: str) -> dict:
    """The bare child beside what `name` starts; returns its stamps and the side work's seconds."""
    from cache import device_stream

    stream = sdk = None
    side: dict = {}
    t0 = time.perf_counter()
    if "stream" in name:
        threads = int(name.split("stream ")[1].split()[0])
        stream = device_stream.start(pack, "cuda:0", threads=threads)
    if name.endswith("sdk"):
        sdk = subprocess.Popen(
            [sys.executable, "-c", "import runpod"],
            cwd=REPO,
            env=child_env(),
            stdin=subprocess.DEVNULL,
        )
    try:
        mode = "bare-gc-off-ctx" if "ctx" in name else "bare-gc-off" if "GC off" in name else "bare"
        stamps = bare_child(mode)
    finally:
        if stream is not None:
            try:
                stream.wait_for(lambda: stream.finished is not None, 120)
                side["stream_s"] = stream.finished.get("since_spawn")
                side["stream_gbps"] = round(
                    os.path.getsize(pack) / 1e9 / max(stream.finished.get("seconds", 1), 1e-9), 1
                )
            finally:
                stream.cancel()
        if sdk is not None:
            sdk.wait(timeout=120)
            side["sdk_s"] = time.perf_counter() - t0
    return {"import_torch_s": stamps["import_torch"], "to_cuda_s": stamps["cuda_init"], **side}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pack", required=True, help="a .cbpack file (page cache warmed first)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--conditions",
        default="alone,stream 16,stream 4,sdk,stream 16 + sdk",
        help="comma-separated, from the list above; the first is the reference",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = ap.parse_args()
    with open(args.pack, "rb") as f:  # warm: the conditions compare CPU and memory, not the disk
        while f.read(64 << 20):
            pass
    conditions = args.conditions.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in conditions}
    bare_child()  # the first interpreter of a fresh machine pays for its pages: not counted
    for i in range(args.runs):
        for c in conditions:
            runs[c].append(run_condition(c, args.pack))
            print(f"round {i} {c}: {runs[c][-1]}", flush=True)
    summary = {}
    for c, rs in runs.items():
        walls = [r["to_cuda_s"] for r in rs]
        summary[c] = {
            "median_to_cuda_s": statistics.median(walls),
            "min_s": min(walls),
            "max_s": max(walls),
            "median_import_torch_s": statistics.median(r["import_torch_s"] for r in rs),
        }
    base = summary[conditions[0]]["median_to_cuda_s"]
    head = f"{'torch':>7} {'torch+CUDA':>11} {'vs first':>9} {'min':>7} {'max':>7}"
    print(f"\n{'condition':<24} {head}")
    for c, s in summary.items():
        m, t = s["median_to_cuda_s"], s["median_import_torch_s"]
        print(
            f"{c:<24} {t:>6.2f}s {m:>10.2f}s {m - base:>+8.2f}s {s['min_s']:>6.2f}s "
            f"{s['max_s']:>6.2f}s"
        )
    import torch  # only to name the device in the record

    os.makedirs(args.out, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "pack": args.pack,
        "pack_bytes": os.path.getsize(args.pack),
        "runs": runs,
        "summary": summary,
    }
    with open(os.path.join(args.out, "start_overlap.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
