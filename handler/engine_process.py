"""The engine's own process under `python -m handler serve`: the start sequence and the AsyncLLM,
answering the server's process over one socket (handler.engine_link lists the messages). It takes
token ids and gives token ids: the server holds the tokenizer (EngineArgs.skip_tokenizer_init).

`python -m handler.engine_process FD`, FD its end of the socket. It begins before the server has
read its settings: the last start's weights and `import torch` first (warmup.start.head_start),
then the start's arguments from the server, the rest of the start, and the requests. It imports no
pydantic, no Starlette and no handler module but this one's link: the server's process does HTTP,
the settings and the OpenAI routes beside it. SIGINT and SIGTERM are the server's to act on: this
process ends when the server says so or its end of the socket closes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from handler import front_link

log = logging.getLogger(__name__)

# The engine's start's name for its records (its start pages; the weight stream it begins early and
# the tokenizer the server loads early: cache.early_stream): its own, as the files it opens are not
# the server's.
ENTRY = "serve-engine"
# how often the counters go to the server (while they change) and a dead engine is looked for
STATS_EVERY_S = 0.1
BACKGROUND_JOIN_S = 10.0  # the most the shutdown waits for the start's background work


def _start_args(data: dict):
    """The server's StartArgs (handler.engine_link.start_message) as this process's; the embedded
    demo model is located here."""
    from warmup.start import StartArgs

    data = dict(data)
    demo = data.pop("embedded", None)
    if demo is not None:

        def locate() -> str:
            from handler.engine_boot import embedded_model_dir

            return embedded_model_dir(demo["cache_dir"], demo["baked_dir"])

        data["locate"] = locate
    data["stream_env"] = tuple(data["stream_env"])
    return StartArgs(**data)


def _failure(exc: BaseException) -> dict:
    """A load failure in the settings' words (handler.engine_boot.load_error)."""
    from handler.engine_boot import load_error

    error = load_error(exc)
    return {"op": "failed", "type": type(error).__name__, "message": str(error)}


def _facts(engine) -> dict:
    core = engine.engine
    return {
        "max_model_len": core.max_model_len,
        "context_limit": core.context_limit,
        "vocab_size": core.model_config.vocab_size,
        "model": core.args.model,
        "block_size": core.args.block_size,
        "max_num_seqs": core.args.max_num_seqs,
        "eos_token_ids": sorted(core.eos_token_ids),
    }


class Link:
    """The engine's side of the socket: each request a task streaming its outputs as deltas."""

    def __init__(self, start, reader, writer):
        self.start = start
        self.reader, self.writer = reader, writer
        self.engine = None
        self.tasks: dict = {}

    def send(self, msg: dict) -> None:
        self.writer.write(front_link.encode(msg))

    async def run(self) -> int:
        import asyncio

        from engine.wire import stats_to_wire

        start = self.start
        reading = asyncio.ensure_future(front_link.receive(self.reader))
        streaming = asyncio.ensure_future(asyncio.to_thread(start.wait_streaming, None))
        loading = asyncio.wrap_future(start.future)
        await asyncio.wait({reading, streaming}, return_when=asyncio.FIRST_COMPLETED)
        if not reading.done() and start.model_dir is not None:  # the server loads its tokenizer
            self.send(
                {
                    "op": "resolved",
                    "model_dir": str(start.model_dir),
                    "tokenizer_dir": str(start.tokenizer_dir),
                }
            )
        await asyncio.wait({reading, loading}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():  # the server ended (or said stop) before the engine was ready
            return 0
        try:
            self.engine = await loading
        except BaseException as exc:  # noqa: BLE001 - reported; the server exits on it
            self.send(_failure(exc))
            await self.writer.drain()
            return 1
        engine = self.engine
        self.send(
            {
                "op": "ready",
                "phases": start.phases,
                "facts": _facts(engine),
                "stats": stats_to_wire(engine.stats_nowait()),
            }
        )
        watch = asyncio.ensure_future(self._watch())
        try:
            while (msg := await reading) is not None:
                reading = asyncio.ensure_future(front_link.receive(self.reader))
                if msg["op"] == "generate":
                    rid = msg["id"]
                    self.tasks[rid] = asyncio.ensure_future(
                        self._generate(rid, msg["prompt"], msg["params"])
                    )
                elif msg["op"] == "eos":  # before any request: the server's tokenizer's
                    try:
                        await engine.add_eos_token_ids(msg["ids"])
                    except ValueError as exc:  # a tokenizer beyond the model's vocabulary
                        log.warning("the tokenizer's end-of-sequence token is not used: %s", exc)
                elif msg["op"] == "abort":
                    task = self.tasks.get(msg["id"])
                    if task is not None:
                        task.cancel()
                elif msg["op"] == "shutdown":
                    break
        finally:
            watch.cancel()
            for task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        return 0 if engine.errored is None else 1

    async def _generate(self, rid: str, prompt, params) -> None:
        import asyncio

        from engine.wire import OutputDeltas, params_from_wire

        deltas = OutputDeltas()
        try:
            async for out in self.engine.generate(rid, prompt, params_from_wire(params)):
                self.send({"op": "out", "id": rid, "delta": deltas.delta(out)})
                await self.writer.drain()
        except asyncio.CancelledError:
            pass  # the server aborted it: the engine's stream closed the request
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            kind = "ValueError" if isinstance(exc, ValueError | TypeError) else type(exc).__name__
            self.send({"op": "error", "id": rid, "type": kind, "message": str(exc)})
        finally:
            if self.tasks.get(rid) is asyncio.current_task():
                del self.tasks[rid]

    async def _watch(self) -> None:
        """The engine's counters to the server while they change; a dead engine reported once."""
        import asyncio

        from engine.wire import stats_to_wire

        last = None
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            errored = self.engine.errored
            if errored is not None:
                self.send({"op": "dead", "type": type(errored).__name__, "message": str(errored)})
                return
            stats = stats_to_wire(self.engine.stats_nowait())
            if stats != last:
                self.send({"op": "stats", "stats": stats})
                last = stats


def main() -> None:
    from warmup.start import EngineStart, head_start, hold_gc, release_gc

    hold_gc()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server drains first, then says stop
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    head = head_start(ENTRY)
    first = front_link.read_first(sock)
    if first is None or first.get("op") != "start":  # the server ended before it began
        from cache.device_stream import cancel_early

        cancel_early()
        release_gc()
        os._exit(0)
    logging.basicConfig(
        level=first["log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    start = EngineStart(_start_args(first["args"]), head).begin()
    code = _serve(start, sock)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the server: no interpreter teardown under a thread inside CUDA or Triton


def _serve(start, sock: socket.socket) -> int:
    import asyncio

    async def run() -> int:
        reader, writer = await front_link.connect(sock)
        link = Link(start, reader, writer)
        try:
            return await link.run()
        finally:
            if link.engine is not None:
                link.engine.shutdown()
                await asyncio.to_thread(start.join_background, BACKGROUND_JOIN_S)

    return asyncio.run(run())


if __name__ == "__main__":
    main()
