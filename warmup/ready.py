"""A worker's kernels before its first request, and never a compile inside a step after it.

warm_kernels() runs once the engine is built, before the worker reports ready: the kernel set of a
first request (prompts of every specialization class, then decode at batch 1; warmup.kernel_set) is
traced with this GPU's driver, so each kernel is loaded from Triton's disk cache (an installed
artifact, a warm cache) or compiled, and its module is on the GPU. It is bounded by a time budget
and timed for the start-up log.

What is not loaded yet is loaded by a background thread: when the first kernels were on disk, right
away; when they had to be compiled (an empty cache), a separate process (`python -m warmup kernels`,
no GPU context, so no step of this worker waits on its compiles) compiles the whole set into this
worker's Triton cache first.

From ready on (capture_in_background, which the start calls), CUDA graphs are captured off the
step loop: a decode batch size (engine.cuda_graphs) or a prompt-step bucket
(engine.piecewise_graphs) is captured by a thread of its own once a step ran at it eagerly, which
loaded its kernels; once the whole set is loaded, the capture thread loads a decode size's kernels
itself, so a size whose steps replay a larger graph is captured too.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

READY_BUDGET_S = 30.0  # tracing stops starting new first-request steps past this
# Tracing holds this interpreter's lock: each kernel the background work compiles or loads waits
# until no request runs or waits (polled this often), at most BUSY_WAIT_S, so a burst that arrives
# while the set loads waits out one kernel's load, not the whole set's.
IDLE_POLL_S = 0.02
BUSY_WAIT_S = 10.0
COMPILE_JOBS = 8  # processes of the background compile, at most half the CPUs


@dataclass
class KernelWarmup:
    """What warm_kernels did, and the background work it left (for the fleet share and the start-up
    log)."""

    seconds: float = 0.0
    kernels: int = 0  # kernels loaded or compiled before ready
    waited_s: float = 0.0  # of `seconds`, the time spent waiting for requests to end
    # Triton cache entries that appeared meanwhile
    compiled: list[str] = field(default_factory=list)
    cache_dir: str | None = None  # this worker's Triton cache
    before: set[str] | None = None  # its entries when the warm-up began
    entries: set[str] = field(default_factory=set)  # cache entries of the loaded kernels
    compile_process: subprocess.Popen | None = None
    compile_list: str | None = None  # where that process writes the entries it compiled or found
    loaded: threading.Event = field(default_factory=threading.Event)  # the whole set is loaded
    thread: threading.Thread | None = None  # the background load of the rest

    def summary(self) -> str:
        made = f", {len(self.compiled)} compiled" if self.compiled else ""
        rest = "; the rest compiled in a background process" if self.compile_process else ""
        waited = f" ({self.waited_s:.2f} s of it waiting for requests)"
        return f"{self.kernels} kernels loaded in {self.seconds:.2f} s{waited}{made}{rest}"


class _Live:
    """The engine's numbers the trace needs, read from the built engine (an AsyncLLM or LLM)."""

    def __init__(self, engine):
        # an AsyncLLM serves while the set loads; a synchronous LLM runs nothing meanwhile
        self.serving = engine if hasattr(engine, "stats_nowait") else None
        core = engine.engine
        self.args, self.runner = core.args, core.runner
        self.max_model_len = core.max_model_len
        backend = (
            self.runner.model.layers[0].self_attn.backend if len(self.runner.model.layers) else None
        )
        # None: not the Triton backend
        self.target_programs = getattr(backend, "target_programs", None)
        self.waited_s = 0.0  # how long the background work has waited for requests to end

    def model(self):
        from warmup.kernel_set import meta_model

        return meta_model(
            self.runner.model_config,
            self.runner.dtype,
            self.target_programs,
            self.runner.model.quant,
        )


def _entries(cache_dir: str) -> set[str]:
    try:
        return set(os.listdir(cache_dir))
    except OSError:
        return set()


class EngineStopped(Exception):
    """The engine stopped (shut down or died) while its kernels loaded: the background work ends."""


def _pause_for(live: _Live):
    """For a serving engine: a call made before each kernel the background work compiles or loads,
    waiting while requests run or wait (at most BUSY_WAIT_S), so that a burst waits out one kernel's
    load rather than a step's trace; it raises EngineStopped once the engine stopped (shutdown then
    waits for one kernel, not the rest of the set). None for a synchronous LLM (nothing serves
    meanwhile)."""
    if live.serving is None:
        return None
    from warmup.fleet import wait_idle

    def pause() -> None:
        t0 = time.perf_counter()
        serving = wait_idle(live.serving, IDLE_POLL_S, BUSY_WAIT_S)
        live.waited_s += time.perf_counter() - t0
        if not serving:
            raise EngineStopped()

    return pause


def _load(kernels: list, pause=None) -> None:
    """Put each kernel's module on the GPU now (Triton does it at a kernel's first launch
    otherwise)."""
    for kernel in kernels:
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            if pause is not None:
                pause()
            init()


def _trace_steps(live: _Live, steps: list, deadline: float | None = None) -> list:
    """Trace `steps` and load their kernels one step at a time, each kernel once the engine is idle
    (_pause_for); stops starting new steps past `deadline` (perf_counter). Raises EngineStopped when
    the engine stops meanwhile."""
    from warmup.kernel_set import trace

    model, loaded, pause = live.model(), [], _pause_for(live)
    for step in steps:
        if deadline is not None and time.perf_counter() > deadline:
            break
        sink: list = []
        trace(
            model,
            [step],
            live.args.block_size,
            live.max_model_len,
            sink,
            live.args.kv_cache_dtype,
            pause,
        )
        _load(sink, pause)
        loaded += sink
    return loaded


def warm_kernels(
    engine, engine_mode: str = "jit", budget_s: float = READY_BUDGET_S
) -> KernelWarmup | None:
    """Load (or compile) a first request's kernels now, and start the background work that loads the
    rest.
    engine_mode: the mode that runs ("jit": the rest of the set is compiled by a background process
    first; "compiled": only if a first kernel was missing from the artifact). None where there is
    nothing to warm (no GPU, no Triton backend) or the engine stopped first."""
    live = _Live(engine)
    if live.runner.device.type != "cuda" or live.target_programs is None:
        return None
    capture_in_background(engine)  # (the start did at ready; a caller without one too)
    try:
        return _warm(live, engine_mode, budget_s)
    except EngineStopped:
        return None


def _warm(live: _Live, engine_mode: str, budget_s: float) -> KernelWarmup:
    import triton

    from warmup.kernel_set import kernel_dirs, steps_for

    t0 = time.perf_counter()
    cache_dir = (
        triton.knobs.cache.dir if hasattr(triton, "knobs") else os.environ.get("TRITON_CACHE_DIR")
    )
    before = _entries(cache_dir)
    first = steps_for(live.args, live.max_model_len, first_only=True)
    kernels = _trace_steps(live, first, t0 + budget_s)
    result = KernelWarmup(
        seconds=time.perf_counter() - t0,
        kernels=len(kernels),
        waited_s=live.waited_s,
        compiled=sorted(_entries(cache_dir) - before),
        cache_dir=cache_dir,
        before=before,
        entries=set(kernel_dirs(kernels)),
    )
    # the rest may be missing: compiled out of this process first
    if engine_mode == "jit" or result.compiled:
        result.compile_process, result.compile_list = _start_compile_process(live, cache_dir)
    done = set(first)
    rest = [s for s in steps_for(live.args, live.max_model_len) if s not in done]
    result.thread = threading.Thread(
        target=_load_rest, args=(live, rest, result), name="coldbrew-kernels", daemon=True
    )
    result.thread.start()
    log.info("kernels: %s", result.summary())
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


def _load_rest(live: _Live, steps: list, result: KernelWarmup) -> None:
    """Background: wait for the compile process (if any), load every other kernel of the set from
    disk, then let the decode graphs' capture thread load a size's kernels itself."""
    from warmup.kernel_set import kernel_dirs

    try:
        if result.compile_process is not None:
            code = _wait_compile(live, result.compile_process)
            if code != 0:
                log.warning(
                    "kernels: the background compile process exited with %d; kernels it did not "
                    "compile compile on first use",
                    code,
                )
            result.entries |= set(_read_list(result.compile_list))
        t0, waited = time.perf_counter(), live.waited_s
        kernels = _trace_steps(live, steps)
        result.entries |= set(kernel_dirs(kernels))
        graphs = live.runner.graphs
        if graphs is not None:
            model = live.model()

            def prepare_size(
                size: int,
            ) -> None:  # the capture thread loads a size's kernels (disk hits)
                from warmup.kernel_set import Step, trace

                width = -(-live.max_model_len // live.args.block_size)
                sink: list = []
                trace(
                    model,
                    [Step(size, size, width, graph=True)],
                    live.args.block_size,
                    live.max_model_len,
                    sink,
                    live.args.kv_cache_dtype,
                )
                _load(sink)

            graphs.prepare_size = prepare_size
        log.info(
            "kernels: the rest of the set (%d kernels) loaded in the background in %.2f s "
            "(%.2f s of it waiting for requests)",
            len(kernels),
            time.perf_counter() - t0,
            live.waited_s - waited,
        )
    except EngineStopped:
        log.debug("kernels: the engine stopped; the background load ends")
    except Exception as exc:  # serving goes on: a kernel not loaded loads or compiles at first use
        log.warning(
            "kernels: loading the kernel set in the background failed: %s: %s",
            type(exc).__name__,
            exc,
        )
    finally:
        result.loaded.set()


def _wait_compile(live: _Live, proc: subprocess.Popen) -> int:
    """The background compile process's exit code; if the engine stops first, the process is
    stopped and EngineStopped raised."""
    if live.serving is None:
        return proc.wait()
    while proc.poll() is None:
        if live.serving.wait_stopped(IDLE_POLL_S * 10):
            proc.terminate()
            raise EngineStopped()
    return proc.returncode


def _read_list(path: str | None) -> list[str]:
    try:
        with open(path) as f:
            return list(json.load(f))
    except (OSError, ValueError, TypeError):
        return []


def _start_compile_process(live: _Live, cache_dir: str) -> tuple[subprocess.Popen, str]:
    """`python -m warmup kernels` for this GPU's architecture and SM count into this worker's Triton
    cache, with no GPU visible (no CUDA context, no GPU memory) and at a low CPU priority."""
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
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(10),
    )
    return proc, listing
