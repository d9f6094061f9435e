"""What loading torch's shared libraries off the interpreter's lock would buy, in fresh
interpreters, page cache warm: an alternative for the start, measured and not adopted.

Python's imports (and ctypes.CDLL) call dlopen holding the interpreter's lock; libc's dlopen called
as a foreign function through ctypes does not. A thread here loads libtorch_global_deps
(RTLD_GLOBAL, as torch's import does) and libtorch (libtorch_cpu, libtorch_cuda, c10) that way, and
the Python beside it is timed.

`python -m bench.torch_libs --runs 5 --out DIR` times, in turn each round:
  bare        `import torch` + CUDA init (the cold-start floor), GC off as the start runs
  preloaded   the libraries loaded, then `import torch` + CUDA init: the loader's share of the
              import, and what is left of it
  spin        the preload beside a Python loop: the loop's rate against the same loop alone says how
              much of the preload leaves the interpreter free
  serial      a fixed piece of pure-Python start work (jinja2, asyncio, email, a large JSON), then
              `import torch` + CUDA init
  overlapped  the same work beside the preload, then `import torch` + CUDA init
Prints one table of medians; writes DIR/torch_libs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import gc, json, sys, time
gc.disable()
t0 = time.perf_counter()
mode = sys.argv[1]
import json as _json, threading
# the extension modules the work below imports, first (as the start does): a Python import of one
# would wait for the loader's lock while a library loads
for name in ("_asyncio _bisect _blake2 _bz2 _contextvars _datetime _hashlib _lzma _pickle _random "
             "_sha2 _sha512 _socket markupsafe select zlib").split():
    try:
        __import__(name)
    except ImportError:
        pass
import ctypes, os, importlib.util
out = {}
LIB = os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "lib")


class Preload:
    def __init__(self):
        self.seconds, self.error, self._done = {}, None, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        dlopen = ctypes.CDLL(None).dlopen
        dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
        for name, flags in (("libtorch_global_deps.so", os.RTLD_NOW | os.RTLD_GLOBAL),
                            ("libtorch.so", os.RTLD_NOW)):
            t = time.perf_counter()
            if not dlopen(os.path.join(LIB, name).encode(), flags):  # the lock is released here
                self.error = name
                break
            self.seconds[name] = time.perf_counter() - t
        self._done.set()

    def done(self):
        return self._done.is_set()

    def wait(self):
        self._done.wait()


def work():
    import asyncio, email.message, email.parser, http.client, jinja2  # noqa: F401
    env = jinja2.Environment()
    for i in range(40):
        env.from_string("{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}" + str(i))
    _json.loads(_json.dumps({f"t{i}": i for i in range(300_000)}))

def spin(done):
    n, t = 0, time.perf_counter()
    while not done():
        n += 1
    return n / (time.perf_counter() - t), time.perf_counter() - t

if mode == "spin":
    end = time.perf_counter() + 0.3
    timer = threading.Event()
    threading.Timer(0.3, timer.set).start()
    alone, _ = spin(timer.is_set)
    p = Preload()
    beside, dt = spin(p.done)
    out.update(spin_alone=alone, spin_beside=beside, preload_s=dt, libs=p.seconds, error=p.error)
    print(json.dumps(out)); sys.exit()
if mode in ("preloaded", "overlapped"):
    p = Preload()
if mode in ("serial", "overlapped"):
    t = time.perf_counter(); work(); out["work_s"] = time.perf_counter() - t
if mode in ("preloaded", "overlapped"):
    t = time.perf_counter(); p.wait(); out["wait_s"] = time.perf_counter() - t
    out["libs"], out["error"] = p.seconds, p.error
t = time.perf_counter()
import torch
out["import_torch_s"] = time.perf_counter() - t
if torch.cuda.is_available():
    t = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out["cuda_init_s"] = time.perf_counter() - t
out["total_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""

MODES = ("bare", "preloaded", "spin", "serial", "overlapped")


def run(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, env=env, timeout=120
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    run("bare")  # the first import of a fresh machine reads the libraries from disk
    for _ in range(args.runs):
        for mode in MODES:
            runs[mode].append(run(mode))
    medians = {}
    for mode, rs in runs.items():
        keys = sorted({k for r in rs for k, v in r.items() if isinstance(v, float)})
        medians[mode] = {k: statistics.median(r[k] for r in rs if k in r) for k in keys}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = {"python": sys.version.split()[0], "runs": runs, "medians": medians}
    (Path(args.out) / "torch_libs.json").write_text(json.dumps(report, indent=1))
    for mode, m in medians.items():
        print(f"{mode:11s} " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()))


if __name__ == "__main__":
    main()
