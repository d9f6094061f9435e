"""The one start sequence: a model reference -> a running AsyncLLM, the weights moving before torch.

The RunPod worker, the HTTP server's engine process and the cold-start benchmark all run it (the
handler through EngineBoot, which turns its settings into StartArgs; the server through
handler.engine_link, which sends them to its engine's process). In order, on a thread of its own,
each phase timed:

  resolve        the model (and tokenizer) reference -> a local snapshot directory (cache.resolve)
  stream_start   the weights set moving: the pack to the GPU from a second process, else the
                 page-cache prefetch (cache.device_stream.start_weights); Triton's compiler key
                 begins in a second interpreter
  tokenizer      the engine's tokenizer loaded (engine.tokenizer.preload), while the GPU's
                 primary context (the one torch then uses) is made on a thread by driver calls that
                 leave the interpreter free; none for an engine whose caller detokenizes
                 (skip_tokenizer_init)
  cuda_context   the wait for that context, made current on this thread
  entry_imports  the entry point's own imports (Starlette and uvicorn; the job handling), which it
                 makes meanwhile; the start waits for them to end (EngineStart.entry_imports)
  import_torch   `import torch` (the floor of any Python engine), the engine's config and weights
  preload_start  the engine's load of the pack begins and takes over what is already moving (the
                 one hand-off of the weights); cuBLAS's first-use setup begins on a thread
                 (engine.device_warmup)
  triton_key     Triton's compiler key, computed meanwhile, handed to Triton (whose settings
                 warmup.triton_env chose before its first import); Triton's runtime then sets
                 itself up on a thread (engine.device_warmup)
  engine_mode    ENGINE_MODE: a compiled engine's kernels and records when one matches, else jit
  import_engine  the engine's modules
  triton_setup   what is left of Triton's runtime setup (nothing, normally)
  engine         its build (model, KV cache, tokenizer) while the last weights arrive
  cublas         what is left of cuBLAS's setup (nothing, normally: it ended during the build)

After ready, once the first request is served, the rest of the kernel set is loaded (or compiled out
of process) in the background (warmup.ready) and shared with the next worker (warmup.fleet).

An engine in a process of its own begins before its arguments come (head_start): the last start's
weight stream and `import torch` first; the sequence then finds them done.

`before_boot` is the time from process start to the start of this sequence (interpreter, settings).
Module-level imports are the stdlib and cache's stdlib-only start modules: importing this costs no
torch.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cache import cuda_driver, early_stream, start_pages
from cache.device_stream import cancel_early, cuda_ordinal, start_weights
from warmup import triton_env
from warmup.ranks import launch as launch_ranks

log = logging.getLogger(__name__)

# cache.resolve's keywords that also reach the S3 store of compiled engines
_S3_KEYS = ("s3_endpoint_url", "aws_access_key_id", "aws_secret_access_key", "aws_region")
# The longest the start waits for an entry point's own imports before importing torch (it normally
# comes nowhere near it).
ENTRY_IMPORTS_WAIT_S = 60.0


class ResolveError(RuntimeError):
    """A reference could not be turned into a local directory: `role` ("model" or "tokenizer") and
    `ref` say which, `__cause__` why."""

    def __init__(self, role: str, ref: str, cause: BaseException):
        super().__init__(f"{role} {ref!r}: could not resolve it: {cause}")
        self.role, self.ref = role, ref


@dataclass(frozen=True)
class StartArgs:
    """What the start needs, as plain values (the handler fills it from its settings, a benchmark by
    hand)."""

    model: str  # a hub repo id, s3://bucket/prefix or local directory: what cache.resolve takes
    cache_dir: str  # the snapshot cache; also holds the start-page record and compiled engines
    revision: str | None = None
    tokenizer: str | None = None  # resolved the same way; None: the model's own
    tokenizer_revision: str | None = None
    # more of cache.resolve's keywords: token, base_path, baked_dir, remote, S3 credentials, verify
    resolve_options: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"  # auto | cuda | cuda:N | cpu
    # EngineArgs fields, but model, tokenizer and device
    engine_options: dict[str, Any] = field(default_factory=dict)
    engine_mode: str = "auto"  # jit | compiled | auto
    locate: Callable[[], str] | None = None  # finds the model's directory instead of cache.resolve
    # the entry starting ("serve-engine", "worker", "worker-api"): its own start pages
    entry: str = ""
    # the environment variables whose values chose this start's weight stream (never secrets):
    # with an entry, the stream is recorded for the next start to begin early (cache.early_stream)
    stream_env: tuple[str, ...] = ()


@dataclass(frozen=True)
class HeadStart:
    """What an engine in a process of its own did before its arguments came (head_start)."""

    began: float  # time.perf_counter() when it began
    age: float | None  # the process's age then (the start's before_boot)
    phases: dict[str, float]  # its phases, seconds: the start adds its own to them


def head_start(entry: str) -> HeadStart | None:
    """The start's first phases, begun before its arguments are known, by an engine whose process
    starts beside the entry point's own and detokenizes nothing (handler.engine_process): the last
    start's weight stream begun again (cache.early_stream, with the GPU's context on a thread),
    Triton's key begun, then `import torch`, while the entry point reads its settings. None, having
    done nothing, when there is no such record (a first start: then the start runs in order once its
    arguments come, the weights moving before torch)."""
    began, age = time.perf_counter(), process_age_s()
    if not early_stream.begin(entry):
        return None
    phases: dict[str, float] = {}
    from warmup.triton_key import start_triton_key

    triton_env.apply()  # before Triton's first import, here and in the key's interpreter
    start_triton_key()  # the start proper takes this one
    t0 = time.perf_counter()
    import torch  # noqa: F401 - the weights are moving: see the module's docstring

    phases["import_torch"] = time.perf_counter() - t0
    return HeadStart(began, age, phases)


_gc_held = False  # hold_gc() turned the cyclic GC off; the end of the start turns it back on


def hold_gc() -> None:
    """Keep Python's cyclic garbage collector off until the start ends (an entry point calls this
    first thing; begin() does too). The start makes millions of objects, torch's import above all,
    and next to no cyclic garbage: every automatic collection meanwhile would only walk them again.
    At the end (ready or failed) what the start made is frozen out of the collector's reach and the
    collector turned back on. Does nothing if the collector was already off."""
    global _gc_held
    if gc.isenabled():
        gc.disable()
        _gc_held = True


def release_gc() -> None:
    """The end of hold_gc(): freeze what exists now, turn the collector back on."""
    global _gc_held
    if _gc_held:
        _gc_held = False
        gc.freeze()
        gc.enable()


def process_age_s() -> float | None:
    """Seconds since this process started, from Linux's /proc (10 ms resolution); None where that is
    not there."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class EngineStart:
    """One run of the start sequence. begin() returns at once; `future` gives the AsyncLLM or the
    error."""

    def __init__(self, args: StartArgs, head: HeadStart | None = None):
        self.args = args
        self.head = head  # what an engine process did before its arguments came (head_start)
        self.phases: dict[str, float] = {}  # phase -> seconds, in the order they ran
        self.model_dir: Path | None = None
        self.tokenizer_dir: Path | None = None  # the tokenizer's, once resolved
        self.weight_stream: str | None = None  # "device_stream" or "prefetch", once started
        self.selection = None  # warmup.artifacts.Selection: jit or compiled, and why
        self.kernels = None  # warmup.ready.KernelWarmup: what the ready-time warm-up loaded
        self._s3 = None  # the S3 options of compiled engines (cache.resolver.make_s3_options)
        self.future: Future = Future()
        self._streaming = threading.Event()  # set once the weights move (or the start failed)
        self._entry_imported = threading.Event()  # clear while an entry point makes its imports
        self._entry_imported.set()
        self._thread: threading.Thread | None = None
        self._tokenizer_path: str | None = None  # preloaded (preload_tokenizer), once begun
        self._background: list[threading.Thread] = []  # the kernel warm-up's and share's threads

    def begin(self) -> EngineStart:
        """Run the sequence on a daemon thread (once; later calls do nothing)."""
        if self._thread is None:
            self.future.set_running_or_notify_cancel()
            hold_gc()
            start_pages.watch_opens()  # the start's own data files join its start pages
            age = process_age_s() if self.head is None else self.head.age
            if age is not None:
                self.phases["before_boot"] = age
            if self.head is not None:
                self.phases.update(self.head.phases)
            self._thread = threading.Thread(target=self._run, name="coldbrew-start", daemon=True)
            self._thread.start()
        return self

    def wait_streaming(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until the weights move or the start failed; True if so.

        A caller with imports of its own waits here first: a local snapshot resolves in
        milliseconds, and the weight stream then starts without sharing this interpreter's lock
        with them. A download does not hold the caller past `timeout`."""
        return self._streaming.wait(timeout)

    def hold_for_entry_imports(self) -> EngineStart:
        """Before begin(): the start waits before `import torch` until an entry_imports() block
        ends (at most ENTRY_IMPORTS_WAIT_S)."""
        self._entry_imported.clear()
        return self

    @contextlib.contextmanager
    def entry_imports(self) -> Iterator[None]:
        """The block where an entry point makes its own heavy imports: while the start makes the
        GPU's context, which leaves this interpreter free, and before `import torch`, which waits
        for the block to end (hold_for_entry_imports).

        Two imports in one interpreter take longer side by side than one after the other: each
        gives up the interpreter's lock on every file it reads and then waits out the other's
        switch interval to get it back; so torch's import does not begin until this block ends."""
        try:
            yield
        finally:
            self._entry_imported.set()

    def _run(self) -> None:
        try:
            try:
                engine = self.run()
            finally:  # before the future wakes a waiter, which may look for it
                if self._tokenizer_path is not None:  # the engine took it, or it failed first
                    discard_tokenizer(self._tokenizer_path, self.args)
        except BaseException as exc:  # reported to every waiter; the caller decides the rest
            cancel_early()  # a stream begun at process start that the start never took
            release_gc()
            log.error("engine failed to load: %s", exc)
            self.future.set_exception(exc)
        else:
            release_gc()
            self.future.set_result(engine)
        finally:
            self._streaming.set()
            self._entry_imported.set()

    def _add_phase(self, phase: str, since: float) -> None:
        """The time since `since`, added to `phase` (to the head start's time for it, if any)."""
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - since

    def _timed(self, phase: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._add_phase(phase, t0)

    def _resolve(self, role: str, ref: str, revision: str | None) -> Path:
        import cache

        a = self.args
        try:
            if role == "model" and a.locate is not None:
                return Path(a.locate())
            options = dict(a.resolve_options)
            if role == "model":  # an unsupported model is refused before any weight moves
                from engine.model_support import check_model_config

                options["check_config"] = check_model_config
            return Path(cache.resolve(ref, revision=revision, cache_dir=a.cache_dir, **options))
        except Exception as exc:
            raise ResolveError(role, ref, exc) from exc

    def run(self):
        """The sequence on the calling thread (begin() runs it on its own thread); returns the
        AsyncLLM or raises."""
        a = self.args
        t0 = time.perf_counter() if self.head is None else self.head.began
        self.model_dir = self._timed("resolve", self._resolve, "model", a.model, a.revision)
        tokenizer_dir = None
        if a.tokenizer:
            tokenizer_dir = self._timed(
                "resolve_tokenizer", self._resolve, "tokenizer", a.tokenizer, a.tokenizer_revision
            )
        self.tokenizer_dir = tokenizer_dir or self.model_dir
        pages = start_pages.default_path(a.cache_dir, a.entry)
        # Tensor parallelism: ranks 1..N-1 start now and stream their own shards; this is rank 0.
        tp_size = a.engine_options.get("tensor_parallel_size", 1)
        want = (a.engine_options.get("dtype", "auto"), a.engine_options.get("quantization"))
        launch_ranks(str(self.model_dir), tp_size, a.device, want)
        self.weight_stream = self._timed(
            "stream_start", start_weights, str(self.model_dir), a.device, pages, (0, tp_size), want
        )
        from warmup.triton_key import start_triton_key

        triton_env.apply()  # before Triton's first import, here and in the key's interpreter
        triton_key = start_triton_key()
        self._streaming.set()
        # Meanwhile the entry point makes its imports, and the driver makes the GPU's context on a
        # thread that holds no interpreter lock: this one does the start's torch-free work then.
        self._begin_cuda_context()
        if not a.engine_options.get("skip_tokenizer_init"):  # else the caller detokenizes
            self._tokenizer_path = str(self.tokenizer_dir)
            self._timed("tokenizer", preload_tokenizer, self._tokenizer_path, a)
        self._timed("cuda_context", self._cuda_context)
        self._timed("entry_imports", self._entry_imported.wait, ENTRY_IMPORTS_WAIT_S)

        t_import = time.perf_counter()
        import torch  # noqa: F401 - the floor: timed on its own

        from engine.config import EngineArgs
        from engine.device_warmup import begin_cublas, begin_triton
        from engine.models.weights import preload_weights  # torch and the config, no model code

        self._add_phase("import_torch", t_import)
        tokenizer = str(tokenizer_dir) if tokenizer_dir else None
        args = EngineArgs(
            model=str(self.model_dir), tokenizer=tokenizer, device=a.device, **a.engine_options
        )
        self._timed("preload_start", preload_weights, args)
        cublas = begin_cublas(args)
        triton_setup = None
        if triton_key is not None:
            self._timed("triton_key", triton_key.install)
            from warmup.compile_log import install as log_compiles

            log_compiles()  # a kernel compiled while serving is named in the log
            triton_setup = begin_triton(args)
        args = self._timed("engine_mode", self._engine_mode, args)
        t_import = time.perf_counter()
        from engine import AsyncLLM

        self.phases["import_engine"] = time.perf_counter() - t_import
        if triton_setup is not None:  # before the build, whose first launches use what it made
            self._timed("triton_setup", triton_setup.join)
        engine = self._timed("engine", AsyncLLM.from_engine_args, args)
        if cublas is not None:
            self._timed("cublas", cublas.join)
        self.phases["total"] = time.perf_counter() - t0
        from warmup.ready import capture_in_background

        capture_in_background(engine)  # no step waits for a graph's capture from here on
        warm = threading.Thread(
            target=self._warm_kernels, args=(engine,), name="coldbrew-kernels", daemon=True
        )
        self._background.append(warm)
        warm.start()
        start_pages.record_in_background(pages)
        if self.weight_stream == "device_stream" and tp_size == 1 and a.entry and a.stream_env:
            stream = dict(
                model_dir=str(self.model_dir), device=a.device, start_pages=pages, want=want
            )
            path = early_stream.record_path(a.cache_dir, a.entry)
            tokenizer = dict(dir=str(self.tokenizer_dir), chat_template=self._chat_template())
            early_stream.record(path, a.stream_env, os.environ, stream, tokenizer)
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items() if k != "total")
        log.info(
            "ready: model %s from %s in %.2fs (%s)",
            a.model,
            self.model_dir,
            self.phases["total"],
            phases,
        )
        return engine

    def _warm_kernels(self, engine) -> None:
        """Once the first request is served and the engine idle: the kernel set traced (compiled
        where missing) by a background process and loaded here (warmup.ready); a worker that had
        to compile then shares its kernels with the next one (warmup.fleet)."""
        from warmup.fleet import share_when_served, wait_served
        from warmup.ready import warm_kernels

        a = self.args
        try:
            if not wait_served(engine):
                return  # shut down unserved (a test, `chat` ended): nothing to warm
            self.kernels = warm_kernels(engine)
            if self.kernels is not None and self.kernels.thread is not None:
                self._background.append(self.kernels.thread)
            share = share_when_served(
                engine,
                self.kernels,
                engine_mode=a.engine_mode,
                selection=self.selection,
                model_dir=str(self.model_dir),
                cache_dir=a.cache_dir,
                remote=a.resolve_options.get("remote"),
                s3_options=self._s3,
                push=a.resolve_options.get("push", True),
            )
            if share is not None:
                self._background.append(share)
        except Exception as exc:  # the worker serves on, compiling lazily as it would without
            log.warning("kernels: background warm-up stopped: %s: %s", type(exc).__name__, exc)

    def join_background(self, timeout: float) -> bool:
        """After the engine's shutdown: wait, at most `timeout` s in all, for the background work
        that began at ready (kernel warm-up, fleet share), which ends once it sees the engine
        stopped; True if none is left running. A process that then exits does not tear its
        interpreter down under a thread inside Triton or the CUDA driver."""
        deadline = time.monotonic() + timeout
        i = 0
        while i < len(self._background):  # the warm-up thread appends the threads it starts
            self._background[i].join(max(0.0, deadline - time.monotonic()))
            i += 1
        return not any(t.is_alive() for t in self._background)

    def _begin_cuda_context(self) -> None:
        """The GPU's primary context begun on a thread of its own (cache.cuda_driver); nothing on
        CPU. _cuda_context then finds it made, or waits for it inside the driver."""
        ordinal = cuda_ordinal(self.args.device)
        if ordinal is not None:
            cuda_driver.begin_primary_context(ordinal)

    def _cuda_context(self) -> None:
        """Make the engine's GPU's primary context current on this thread (torch's CUDA start then
        finds it made): driver calls through ctypes, which leave the interpreter to the entry
        point's imports. Nothing on CPU or without a driver or device: torch decides then."""
        ordinal = cuda_ordinal(self.args.device)
        if ordinal is None:
            return
        try:
            cuda_driver.primary_context(ordinal)
        except (cuda_driver.CudaError, OSError) as exc:
            log.debug("no CUDA context before torch: %s", exc)

    def _chat_template(self) -> str | None:
        return self.args.engine_options.get("chat_template")

    def _engine_mode(self, args):
        from cache.resolver import make_s3_options
        from warmup.artifacts import prepare

        a = self.args
        s3 = make_s3_options(
            **{k: a.resolve_options[k] for k in _S3_KEYS if k in a.resolve_options}
        )
        self._s3 = s3
        args, self.selection = prepare(
            a.engine_mode, args, a.cache_dir, a.resolve_options.get("remote"), s3
        )
        log.info("engine mode: %s (%s)", self.selection.mode, self.selection.reason)
        return args


def preload_tokenizer(path: str, args: StartArgs) -> bool:
    """The engine's tokenizer loaded ahead of its build (engine.tokenizer.preload: no torch)."""
    from engine.tokenizer import preload

    return preload(path, args.engine_options.get("chat_template"))


def discard_tokenizer(path: str, args: StartArgs) -> None:
    """What preload_tokenizer left, if the engine did not take it."""
    from engine.tokenizer import discard_preload

    discard_preload(path, args.engine_options.get("chat_template"))


def start_engine(args: StartArgs) -> EngineStart:
    """Begin the start sequence on its own thread and return at once (see EngineStart)."""
    return EngineStart(args).begin()
