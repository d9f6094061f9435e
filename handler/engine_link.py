"""The server's side of the engine's own process (handler.engine_process) under `python -m handler
serve`: the process started first thing, the start's arguments sent once the settings are read, and
an engine and a boot that the server and the OpenAI routes use as they use the in-process AsyncLLM
and EngineBoot.

Why two processes: the server's start (its settings' pydantic, Starlette and uvicorn, the routes,
its tokenizer, each request's parsing and tokenizing) and the engine's (`import torch`, the build)
are Python each, and in one interpreter they run one after the other; here the engine's runs beside
the server's, from process start. One Unix socket joins them, one JSON object per line
(handler.front_link's encoding):

  server -> engine  {"op": "start", "args": {...}, "log_level": L}     once, first
                    {"op": "eos", "ids": [...]}              the tokenizer's end token, once
                    {"op": "generate", "id": R, "prompt": P, "params": {...}}  (engine.wire)
                    {"op": "abort", "id": R}                 the request's reader left
                    {"op": "shutdown"}                       the server is done with it
  engine -> server  {"op": "resolved", "model_dir": D, "tokenizer_dir": T}   the weights move
                    {"op": "ready", "phases": {...}, "facts": {...}, "stats": {...}}
                    {"op": "failed", "type": T, "message": M}  the start failed; it exits
                    {"op": "out", "id": R, "delta": {...}}   what request R has new (engine.wire)
                    {"op": "error", "id": R, "type": T, "message": M}  request R failed
                    {"op": "stats", "stats": {...}}          the engine's counters, as they change
                    {"op": "dead", "type": T, "message": M}  the engine died (a CUDA fault, ...)

The engine runs without its tokenizer (EngineArgs.skip_tokenizer_init): it takes token ids and
gives token ids, and the server's process, which holds the tokenizer (chat templates, prompts, tool
calls), makes the outputs' text, stop strings and logprobs' tokens (engine.output_text); so the
tokenizer's load is off the engine's way to its first token.
"""

from __future__ import annotations

import dataclasses
import subprocess
from contextlib import nullcontext
from types import SimpleNamespace

from handler import front_link
from handler.engine_process import ENTRY

# What the first request would otherwise import here, between the engine's ready and its first
# token: the wire and the outputs' text (engine.output_text), and Starlette's streaming response's
# anyio backend. The server's process imports them while the engine's process still starts.
REQUEST_PATH_MODULES = (
    "engine.outputs",
    "engine.wire",
    "engine.output_text",
    "anyio._backends._asyncio",
)


class EngineGone(RuntimeError):
    """The engine's process ended while the server still needed it."""


class RemoteError(RuntimeError):
    """An error the engine's process reported, as remote_error() makes it."""


_REMOTE_ERRORS: dict[str, type[RemoteError]] = {}


def remote_error(kind: str, message: str) -> RemoteError:
    """An error the engine's process reported, under its type's name there (so a request's 500 and
    the server's log name it as the one-process server does)."""
    cls = _REMOTE_ERRORS.get(kind)
    if cls is None:
        cls = _REMOTE_ERRORS[kind] = type(kind, (RemoteError,), {"__module__": __name__})
    return cls(message)


class EngineProcess:
    """The engine's process, started with this process's environment; `sock` is the server's end."""

    def __init__(self) -> None:
        self.sock, self.proc = front_link.spawn("handler.engine_process")

    def send_start(self, args, log_level: str, baked_dir: str | None) -> None:
        self.sock.sendall(front_link.encode(start_message(args, log_level, baked_dir)))

    def close(self) -> None:
        """The server's end closed: the engine's process ends (before its start, at once)."""
        self.sock.close()


def start_message(args, log_level: str, baked_dir: str | None = None) -> dict:
    """warmup.start.StartArgs as JSON: secrets as their text (the socket is this pair's alone), the
    embedded demo model's locate as the two paths it needs."""
    from warmup.start import StartArgs

    data = {f.name: getattr(args, f.name) for f in dataclasses.fields(StartArgs)}
    locate = data.pop("locate")
    data["resolve_options"] = {
        k: v.get_secret_value() if hasattr(v, "get_secret_value") else v
        for k, v in args.resolve_options.items()
    }
    if locate is not None:
        data["embedded"] = {"cache_dir": args.cache_dir, "baked_dir": baked_dir}
    return {"op": "start", "args": data, "log_level": log_level}


class RemoteEngine:
    """The engine in its process as the routes use an AsyncLLM: generate() streams cumulative
    outputs (put together from the engine's deltas), the tokenizer is this process's own, `engine`
    holds the engine's limits, stats_nowait() its latest counters."""

    def __init__(self, link: RemoteLink, tokenizer, facts: dict, stats: dict):
        self._link = link
        self.tokenizer = tokenizer
        f = facts
        self.engine = SimpleNamespace(
            max_model_len=f["max_model_len"],
            context_limit=f["context_limit"],
            model_config=SimpleNamespace(vocab_size=f["vocab_size"]),
            args=SimpleNamespace(
                model=f["model"], block_size=f["block_size"], max_num_seqs=f["max_num_seqs"]
            ),
        )
        self.take_stats(stats)
        self.eos_token_ids = set(f["eos_token_ids"])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
            link.send({"op": "eos", "ids": [tokenizer.eos_token_id]})

    @property
    def errored(self) -> BaseException | None:
        return self._link.errored

    def stats_nowait(self):
        return self._stats

    def take_stats(self, data: dict) -> None:
        """The engine's latest counters (engine.wire)."""
        from engine.wire import stats_from_wire

        self._stats = stats_from_wire(data)

    async def generate(self, request_id: str, prompt, params=None):
        import asyncio

        from engine.output_text import OutputText, engine_params
        from engine.wire import OutputAssembly, params_to_wire

        link = self._link
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        if isinstance(prompt, str):
            prompt = await asyncio.to_thread(self.tokenizer.encode, prompt)
        if link.errored is not None:
            raise RuntimeError(f"engine is dead: {link.errored!r}")
        if request_id in link.streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        link.streams[request_id] = queue
        assembly = OutputAssembly(request_id)
        text = OutputText(self.tokenizer, params, self.eos_token_ids)
        engine_done = finished = False
        try:
            link.send(
                {
                    "op": "generate",
                    "id": request_id,
                    "prompt": prompt,
                    "params": params_to_wire(engine_params(params)),
                }
            )
            while not finished:
                items = [await queue.get()]
                while not queue.empty():  # a slow reader takes what came meanwhile at once
                    items.append(queue.get_nowait())
                out = None
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    engine_out = assembly.apply(item)
                    engine_done = engine_out.finished
                    out = text.process(engine_out)
                    if out.finished:  # a stop string can end it before the engine knows
                        break
                finished = out.finished
                yield out
        finally:
            if link.streams.get(request_id) is queue:
                del link.streams[request_id]
            if not engine_done and link.errored is None:
                link.send({"op": "abort", "id": request_id})

    def shutdown(self) -> None:
        self._link.shutdown()


class RemoteLink:
    """The server's end of the socket, read on its event loop; what the engine's process says goes
    to the boot (start), the engine (counters) and each request's stream."""

    def __init__(self, process: EngineProcess, boot: RemoteBoot):
        self.process = process
        self.boot = boot
        self.streams: dict = {}
        self.errored: BaseException | None = None
        self.writer = None
        self.engine: RemoteEngine | None = None
        self._closing = False

    def send(self, msg: dict) -> None:
        if self.writer is not None and not self._closing:
            self.writer.write(front_link.encode(msg))

    async def run(self) -> None:
        import asyncio

        reader, self.writer = await front_link.connect(self.process.sock)
        while (msg := await front_link.receive(reader)) is not None:
            self._take(msg)
        code = await asyncio.to_thread(self.process.proc.wait)
        if not self._closing:
            self._die(EngineGone(f"the engine's process exited (code {code})"))

    def _take(self, msg: dict) -> None:
        op = msg["op"]
        if op == "out":
            queue = self.streams.get(msg["id"])
            if queue is not None:
                queue.put_nowait(msg["delta"])
        elif op == "error":
            queue = self.streams.get(msg["id"])
            if queue is not None:
                kind, message = msg["type"], msg["message"]
                queue.put_nowait(
                    ValueError(message) if kind == "ValueError" else remote_error(kind, message)
                )
        elif op == "stats" and self.engine is not None:
            self.engine.take_stats(msg["stats"])
        elif op == "resolved":
            self.boot.resolved(msg["model_dir"], msg["tokenizer_dir"])
        elif op == "ready":
            self.boot.engine_ready(self, msg)
        elif op == "failed":
            self.boot.start_failed(msg["type"], msg["message"])
        elif op == "dead":
            self._die(remote_error(msg["type"], msg["message"]))

    def _die(self, exc: BaseException) -> None:
        if self.errored is None:
            self.errored = exc
        for queue in self.streams.values():
            queue.put_nowait(exc)
        self.boot.start_failed(type(exc).__name__, str(exc))

    def shutdown(self) -> None:
        """Tell the engine's process to stop (its requests end); it then exits."""
        self.send({"op": "shutdown"})
        self._closing = True


class RemoteBoot:
    """EngineBoot's face for the server, for an engine in its own process: ready() gives the
    RemoteEngine once the engine's process is ready and this process has the tokenizer."""

    def __init__(self, settings, process: EngineProcess):
        from handler.engine_boot import start_args

        self.settings = settings
        self.process = process
        args = start_args(settings, ENTRY)
        # the engine gives token ids; this process detokenizes (engine.output_text)
        options = dict(args.engine_options, skip_tokenizer_init=True)
        self.args = dataclasses.replace(args, engine_options=options)
        self.phases: dict[str, float] = {}
        self.model_dir: str | None = None
        self._tokenizer = None  # a Future of this process's tokenizer, once resolved
        self._ready = None  # asyncio.Future of the RemoteEngine
        self._failed: BaseException | None = None
        self._engine: RemoteEngine | None = None
        self._link: RemoteLink | None = None
        self._reading = None  # the task reading the engine's process, once started
        self._guess = None  # (directory, template) of the tokenizer loaded on a guess, its thread
        process.send_start(self.args, settings.log_level, settings.baked_model_dir)
        self._begin_request_path()

    def _begin_request_path(self) -> None:
        """On a thread, while the settings' work goes on: this process's tokenizer loaded on the
        engine's guess (cache.early_stream; the resolved one takes it if the guess was right), then
        the first request's imports (REQUEST_PATH_MODULES)."""
        import threading

        from cache import early_stream

        hint = early_stream.tokenizer_hint(ENTRY)

        def load() -> None:
            import importlib

            if hint is not None:
                from engine.tokenizer import preload

                preload(*hint)
            for module in REQUEST_PATH_MODULES:
                try:
                    importlib.import_module(module)
                except ImportError:  # another anyio's layout: the first request imports its own
                    pass

        thread = threading.Thread(target=load, name="coldbrew-tokenizer", daemon=True)
        thread.start()
        if hint is not None:
            self._guess = (hint, thread)

    # ---- EngineBoot's face -----------------------------------------------------------------------
    def entry_imports(self):
        return nullcontext()  # the engine imports torch in its own process: nothing waits

    def start(self, head_start_s: float = 0.0) -> RemoteBoot:
        """Begin reading the engine's process (on the running event loop; once)."""
        import asyncio

        if self._link is None:
            loop = asyncio.get_running_loop()
            self._ready = loop.create_future()
            self._link = RemoteLink(self.process, self)
            self._reading = asyncio.ensure_future(self._link.run())
        return self

    @property
    def is_ready(self) -> bool:
        return self._engine is not None

    @property
    def failed(self) -> BaseException | None:
        return self._failed if self._engine is None else None

    def engine_now(self) -> RemoteEngine | None:
        return self._engine

    async def ready(self) -> RemoteEngine:
        import asyncio

        self.start()
        return await asyncio.shield(self._ready)

    @property
    def served_names(self) -> list[str]:
        from handler.engine_boot import served_names

        return served_names(self.settings, self.model_dir)

    def join_background(self, timeout: float) -> bool:
        """After shutdown: the engine's process ended (at most `timeout` s)."""
        try:
            self.process.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    # ---- what the engine's process says ---------------------------------------------------------
    def resolved(self, model_dir: str, tokenizer_dir: str) -> None:
        import asyncio

        self.model_dir = model_dir
        template = self.args.engine_options.get("chat_template")
        self._tokenizer = asyncio.ensure_future(
            asyncio.to_thread(_load_tokenizer, tokenizer_dir, template, self._guess)
        )

    def engine_ready(self, link: RemoteLink, msg: dict) -> None:
        import asyncio

        async def settle() -> None:
            try:
                tokenizer = await self._tokenizer if self._tokenizer is not None else None
            except Exception as exc:  # noqa: BLE001 - the engine loaded it: this is a fault here
                self.start_failed(type(exc).__name__, f"the server's tokenizer: {exc}")
                return
            self.phases = msg["phases"]
            engine = RemoteEngine(link, tokenizer, msg["facts"], msg["stats"])
            link.engine = engine
            self._engine = engine
            if not self._ready.done():
                self._ready.set_result(engine)

        asyncio.ensure_future(settle())

    def start_failed(self, kind: str, message: str) -> None:
        from handler.engine_boot import ModelLoadError

        if self._failed is None and self._engine is None:
            self._failed = (
                ModelLoadError(message) if kind == "ModelLoadError" else remote_error(kind, message)
            )
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(self._failed)
                self._ready.exception()  # retrieved: a boot nobody awaited logs nothing


def _load_tokenizer(path: str, chat_template: str | None, guess: tuple | None):
    """The tokenizer as the engine loads it (engine.core), taking the one loaded on `guess` (its
    arguments, its thread) if that was right and dropping it if not, its chat templates compiled;
    None without a tokenizer.json."""
    from engine.tokenizer import discard_preload, load_if_present

    if guess is not None:
        guess[1].join()
        guess = guess[0]
    try:
        tokenizer = load_if_present(path, chat_template)
    finally:
        if guess is not None:
            discard_preload(*guess)  # nothing, when from_dir took it
    if tokenizer is not None:  # the first chat request's compile, while the engine still starts
        tokenizer.prepare_chat_templates()
    return tokenizer
