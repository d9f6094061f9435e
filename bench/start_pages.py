"""What the start path reads from disk: drop the page cache, run one command, then count the
resident pages of every file under the Python roots it imports from (torch, the nvidia wheels,
triton, the stdlib, ...).

`python -m bench.start_pages [--json OUT] -- python -c "import torch; ..."`: prints the command's
wall time and the bytes per file (largest first). Needs permission to write /proc/sys/vm/drop_caches
(the GPU machine has it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time

from bench.cold_start import drop_caches
from cache.prefetch import resident_fraction


def roots() -> list[str]:
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return sorted(p for p in paths if os.path.isdir(p))


def resident_files(dirs: list[str]) -> dict[str, int]:
    out = {}
    for root in dirs:
        for here, _, names in os.walk(root):
            for n in names:
                p = os.path.join(here, n)
                try:
                    size = os.path.getsize(p)
                    frac = resident_fraction(p) if size else 0.0
                except OSError:
                    continue
                if frac:
                    out[p] = int(frac * size)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    method = drop_caches("/nonexistent")
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    files = resident_files(roots())
    total = sum(files.values())
    print(
        f"{' '.join(cmd)[:100]}: {wall:.2f} s with caches dropped ({method}); "
        f"{total / 1e6:.0f} MB resident in {len(files)} files under {roots()}"
    )
    for p, n in sorted(files.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{n / 1e6:10.1f} MB  {p}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"cmd": cmd, "wall_s": wall, "total_bytes": total, "files": files}, f, indent=1
            )


if __name__ == "__main__":
    sys.exit(main())
