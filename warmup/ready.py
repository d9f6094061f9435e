"""A worker's kernels loaded in the background after its first request, and never a compile inside a
step after it.

warm_kernels() runs once the worker has served its first request and is idle. A background process
(`python -m warmup kernels`: no GPU visible, a low CPU priority) traces the engine's whole kernel
set (warmup.kernel_set) for this GPU's architecture into this worker's Triton cache: it finds each
kernel there (an installed artifact, a warm cache) or compiles it, and lists every kernel's
specialization data for this GPU's SM count. This process then puts each listed kernel in Triton's
JIT cache (JITFunction.preload: read from disk, nothing traced) and its module on the GPU, one
kernel at a time, each once no request runs or waits, so a burst that arrives meanwhile waits out
one kernel's load at most. The trace itself never runs here: on meta tensors it runs torch's Python
meta kernels, whose first call imports a large part of torch (about a second of this interpreter's
lock, which every step of a burst would share). Until a kernel is loaded, a step that needs it
loads it (or compiles it) at its first launch, as without this warm-up.

From ready on (capture_in_background, which the start calls), CUDA graphs are captured off the
step loop: a decode batch size (engine.cuda_graphs) or a prompt-step bucket
(engine.piecewise_graphs) is captured by a thread of its own once a step ran at it eagerly, which
loaded its kernels; once the whole set is loaded, a decode size is captured without that first
eager step, so a size whose steps replay a larger graph is captured too.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# Each kernel the background work loads waits until no request runs or waits (polled this often), at
# most BUSY_WAIT_S.
IDLE_POLL_S = 0.02
BUSY_WAIT_S = 10.0
COMPILE_JOBS = 8  # processes of the background trace, at most half the CPUs


@dataclass
class KernelWarmup:
    """What warm_kernels started and, once `loaded` is set, what it did (for the fleet share and the
    start-up log)."""

    seconds: float = 0.0  # from warm_kernels to the whole set loaded
    traced_s: float = 0.0  # of `seconds`, the background process's trace
    kernels: int = 0  # kernels put in the JIT's cache and on the GPU here
    waited_s: float = 0.0  # of `seconds`, the time the loads waited for requests to end
    skipped: int = 0  # listed kernels that could not be preloaded (they load at first use)
    # Triton cache entries that appeared since warm_kernels (compiled by the process or a step)
    compiled: list[str] = field(default_factory=list)
    cache_dir: str | None = None  # this worker's Triton cache
    before: set[str] | None = None  # its entries when the warm-up began
    entries: set[str] = field(default_factory=set)  # cache entries of the set
    compile_process: subprocess.Popen | None = None
    compile_list: str | None = None  # where that process writes the set
    loaded: threading.Event = field(default_factory=threading.Event)  # the whole set is loaded
    thread: threading.Thread | None = None  # the background load

    def summary(self) -> str:
        made = f", {len(self.compiled)} compiled" if self.compiled else ""
        skipped = f", {self.skipped} left to load at first use" if self.skipped else ""
        return (
            f"the set's {self.kernels} kernels loaded in the background in {self.seconds:.2f} s "
            f"({self.traced_s:.2f} s of it tracing the set in a background process, "
            f"{self.waited_s:.2f} s waiting for requests){made}{skipped}"
        )


class _Live:
    """The engine's numbers the warm-up needs, read from the built engine (an AsyncLLM or LLM)."""

    def __init__(self, engine):
        # an AsyncLLM serves while the set loads; a synchronous LLM runs nothing meanwhile
        self.serving = engine if hasattr(engine, "stats_nowait") else None
        core = engine.engine
        self.args, self.runner = core.args, core.runner
        backend = (
            self.runner.model.layers[0].self_attn.backend if len(self.runner.model.layers) else None
        )
        # None: not the Triton backend
        self.target_programs = getattr(backend, "target_programs", None)


def _entries(cache_dir: str) -> set[str]:
    try:
        return set(os.listdir(cache_dir))
    except OSError:
        return set()


class EngineStopped(Exception):
    """The engine stopped (shut down or died) while its kernels loaded: the background work ends."""


def _pause_for(live: _Live, result: KernelWarmup):
    """For a serving engine: a call made before each kernel the background work loads, waiting
    while requests run or wait (at most BUSY_WAIT_S), so that a burst waits out one kernel's load,
    and adding the wait to result.waited_s; it raises EngineStopped once the engine stopped
    (shutdown then waits for one kernel, not the rest of the set). None for a synchronous LLM
    (nothing serves meanwhile)."""
    if live.serving is None:
        return None
    from warmup.fleet import wait_idle

    def pause() -> None:
        t0 = time.perf_counter()
        serving = wait_idle(live.serving, IDLE_POLL_S, BUSY_WAIT_S)
        result.waited_s += time.perf_counter() - t0
        if not serving:
            raise EngineStopped()

    return pause


def _jit_function(module: str, name: str):
    """The JITFunction `module`.`name` (its qualified name) of a preload record."""
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def preload(records: list[dict], pause=None) -> tuple[list, int]:
    """Each record's kernel ({module, name, data}: warmup.aot.KernelSet.preload) into Triton's JIT
    cache from the disk cache (compiled there if missing), then its module onto the GPU; `pause`
    before each step of each. Returns (the kernels, how many records failed: a failed record's
    kernel loads at its first launch instead)."""
    kernels, failed = [], 0
    for record in records:
        if pause is not None:
            pause()
        try:
            kernel = _jit_function(record["module"], record["name"]).preload(record["data"])
        except Exception as exc:  # noqa: BLE001 - a stale or foreign record: first use loads it
            failed += 1
            log.debug("kernels: could not preload %s: %s", record.get("name"), exc)
            continue
        if kernel is not None:
            kernels.append(kernel)
    for kernel in kernels:
        if pause is not None:
            pause()
        kernel._init_handles()
    return kernels, failed


def warm_kernels(engine) -> KernelWarmup | None:
    """Start the background work that loads the engine's kernel set (see the module's docstring).
    None where there is nothing to warm (no GPU, no Triton backend)."""
    import triton

    live = _Live(engine)
    if live.runner.device.type != "cuda" or live.target_programs is None:
        return None
    capture_in_background(engine)  # (the start did at ready; a caller without one too)
    cache_dir = (
        triton.knobs.cache.dir if hasattr(triton, "knobs") else os.environ.get("TRITON_CACHE_DIR")
    )
    result = KernelWarmup(cache_dir=cache_dir, before=_entries(cache_dir))
    result.compile_process, result.compile_list = _start_compile_process(live, cache_dir)
    log.info(
        "kernels: tracing the set in a background process (pid %d)", result.compile_process.pid
    )
    result.thread = threading.Thread(
        target=_load_set,
        args=(live, result, time.perf_counter()),
        name="coldbrew-kernels",
        daemon=True,
    )
    result.thread.start()
    return result


def capture_in_background(engine) -> None:
    """`engine`'s (an AsyncLLM or LLM) CUDA graphs captured off its step loop from now on (see the
    module's docstring); nothing where it runs without graphs, or over several GPUs (each rank
    replays or captures a size in the same step, so their collectives pair up)."""
    runner = engine.engine.runner
    if runner.tp is not None:
        return
    if runner.graphs is not None:
        runner.graphs.background = True
    if runner.pieces is not None:
        runner.pieces.background = True


def _load_set(live: _Live, result: KernelWarmup, t0: float) -> None:
    """Background: wait for the trace process, preload the kernels it listed for this GPU, then let
    the decode graphs' capture thread capture a size with no eager step first."""
    import torch

    try:
        if live.runner.device.index is not None:  # this thread loads onto the engine's GPU
            torch.cuda.set_device(live.runner.device)
        code = _wait_compile(live, result.compile_process)
        result.traced_s = time.perf_counter() - t0
        if code != 0:
            log.warning(
                "kernels: the background trace of the kernel set exited with %d; kernels load "
                "(or compile) at their first use",
                code,
            )
        entries, records = _read_set(result.compile_list)
        result.entries |= set(entries)
        sm_count = torch.cuda.get_device_properties(live.runner.device).multi_processor_count
        mine = [r for r in records if r.get("sm_count") == sm_count]
        kernels, result.skipped = preload(mine, _pause_for(live, result))
        result.kernels = len(kernels)
        whole = code == 0 and mine and not result.skipped  # else steps still load some kernels
        if whole and live.runner.graphs is not None:
            live.runner.graphs.kernels_loaded = True
        result.compiled = sorted(_entries(result.cache_dir) - result.before)
        result.seconds = time.perf_counter() - t0
        log.info("kernels: %s", result.summary())
    except EngineStopped:
        log.debug("kernels: the engine stopped; the background load ends")
    except Exception as exc:  # serving goes on: a kernel not loaded loads or compiles at first use
        log.warning(
            "kernels: loading the kernel set in the background failed: %s: %s",
            type(exc).__name__,
            exc,
        )
    finally:
        with contextlib.suppress(OSError):
            os.unlink(result.compile_list)
        result.loaded.set()


def _wait_compile(live: _Live, proc: subprocess.Popen) -> int:
    """The background trace process's exit code; if the engine stops first, the process is stopped
    and EngineStopped raised."""
    if live.serving is None:
        return proc.wait()
    while proc.poll() is None:
        if live.serving.wait_stopped(IDLE_POLL_S * 10):
            proc.terminate()
            raise EngineStopped()
    return proc.returncode


def _read_set(path: str | None) -> tuple[list[str], list[dict]]:
    """(cache entries, preload records) the trace process wrote; empty where it wrote nothing."""
    try:
        with open(path) as f:
            found = json.load(f)
        return list(found["entries"]), list(found["preload"])
    except (OSError, ValueError, TypeError, KeyError):
        return [], []


def _start_compile_process(live: _Live, cache_dir: str) -> tuple[subprocess.Popen, str]:
    """`python -m warmup kernels` for this GPU's architecture and SM counts (its own, and its
    architecture's others for the fleet's artifact) into this worker's Triton cache, with no GPU
    visible (no CUDA context, no GPU memory) and at a low CPU priority."""
    import tempfile

    import torch

    from warmup.aot import ARCH_SM_COUNTS

    props = torch.cuda.get_device_properties(live.runner.device)
    arch = f"sm_{props.major}{props.minor}"
    counts = sorted({props.multi_processor_count, *ARCH_SM_COUNTS.get(arch, ())})
    fd, listing = tempfile.mkstemp(prefix="coldbrew-kernels-", suffix=".json")
    os.close(fd)
    jobs = max(1, min(COMPILE_JOBS, (os.cpu_count() or 2) // 2))
    cmd = [
        sys.executable,
        "-m",
        "warmup",
        "kernels",
        "--arch",
        arch,
        "--sm-count",
        ",".join(map(str, counts)),
        "--triton-cache",
        cache_dir,
        "--list",
        listing,
        "--jobs",
        str(jobs),
        "--engine-args",
        json.dumps(vars(live.args)),
    ]
    # where `warmup` is imported from
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    # its warnings reach this worker's log
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    # (it lowers its own priority: no preexec_fn, so no fork of this large process)
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return proc, listing
