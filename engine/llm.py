"""The engine's two fronts: LLM (blocking, batch in -> outputs out) and AsyncLLM (per-request async
streams, abort).

AsyncLLM runs the engine core's step loop on one background thread, the only one that touches the
core and the table of open streams: adds, aborts and closes are queued to it and run between steps,
so an abort that returns has already freed the request's blocks, and a request id reused after a
close never receives the old request's output.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from engine.config import EngineArgs
from engine.core import EngineCore, EngineStats, PromptType, RequestFailed
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine without a tokenizer (skip_tokenizer_init) never loads one
    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Messages = list[dict]


def _engine_args(model: str | None, engine_args: EngineArgs | None, kwargs: dict) -> EngineArgs:
    if engine_args is not None:
        return engine_args
    if model is None:
        raise ValueError("model: a model directory is required")
    return EngineArgs(model=model, **kwargs)


class LLM:
    """Offline inference: `LLM(model=dir).generate(prompts, SamplingParams(...))`."""

    def __init__(
        self, model: str | None = None, *, engine_args: EngineArgs | None = None, **kwargs
    ):
        self.engine = EngineCore(_engine_args(model, engine_args, kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        return cls(engine_args=engine_args)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def capture_cuda_graphs(self) -> float:
        """Capture every decode graph size not captured yet; the seconds it took (0 without
        graphs)."""
        return self.engine.capture_cuda_graphs()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one device); the engine is
        unusable after."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion and return their outputs in input order.

        A prompt the engine can't serve raises ValueError before anything runs; the engine stays
        usable."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        return self._run(list(prompts), params)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("messages: this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            tok.encode_chat(
                conv,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template=chat_template,
                **template_kwargs,
            )
            for conv in conversations
        ]
        return self._run(prompts, _per_prompt(sampling_params, len(prompts)))

    def _run(self, prompts: list[PromptType], params: list[SamplingParams]) -> list[RequestOutput]:
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
        # interrupted (Ctrl-C, an engine error): leave nothing running behind the caller's back
        finally:
            for rid in pending:
                self.engine.abort(rid)
        return [final[rid] for rid in ids]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return list(params)


class AsyncLLM:
    """Online inference: `async for out in engine.generate(request_id, prompt, params)` streams
    cumulative outputs; `await engine.abort(request_id)` ends a request and frees its KV blocks
    before it returns."""

    def __init__(
        self, model: str | None = None, *, engine_args: EngineArgs | None = None, **kwargs
    ):
        self.engine = EngineCore(_engine_args(model, engine_args, kwargs))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="coldbrew-engine", daemon=True)
        self._thread.start()
        self.engine.on_rank_death(self._rank_died)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLM":
        return cls(engine_args=engine_args)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self._call(self.engine.stats).result()

    async def capture_cuda_graphs(self) -> float:
        """Capture every decode graph size not captured yet, on the engine thread between steps; the
        seconds it took."""
        return await asyncio.wrap_future(self._call(self.engine.capture_cuda_graphs))

    def stats_nowait(self) -> EngineStats:
        """The counters read on the caller's thread without waiting for a step (admission control,
        /metrics).

        Each is one plain read of an int or a length, so a snapshot may straddle a step; never use
        it for accounting."""
        return self.engine.stats()

    @property
    def errored(self) -> BaseException | None:
        return self._error

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the engine to stop (shut down, or dead); True if it has:
        nothing more will be served."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the engine thread: the only one that touches the engine core and the stream table
    # -----------------
    def _call(self, fn: Callable, *args) -> Future:
        """Run fn(*args) on the engine thread between two steps."""
        if self._error is not None:
            raise RuntimeError(f"engine is dead: {self._error!r}")
        if self._stopped:
            raise RuntimeError("engine is shut down")
        fut: Future = Future()
        # Running: an awaiting task that is cancelled can't cancel the command (it still runs, in
        # order), so the engine thread never finds a cancelled future it can't complete.
        fut.set_running_or_notify_cancel()
        self._commands.put((fn, args, fut))
        self._wakeup.set()
        return fut

    def _run_commands(self) -> None:
        while True:
            try:
                fn, args, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn(*args))
            except Exception as exc:  # a bad request: its caller gets the error, the engine goes on
                fut.set_exception(exc)

    def _loop(self) -> None:
        try:
            while not self._stopped and self._error is None:
                self._run_commands()
                if not self.engine.has_unfinished():
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except (
                    RequestFailed
                ) as failed:  # that request alone ends, with its error; the others go on
                    self._deliver(failed.request_id, failed)
                    continue
                self._deliver_all([(out.request_id, out) for out in outputs])
        except BaseException as exc:  # a fault of the machine or the engine
            log.exception("engine loop failed")
            self._error = exc
        finally:  # every open stream and queued command learns that the engine is gone
            gone = self._error or RuntimeError("engine is shut down")
            self._deliver_all([(rid, gone) for rid in list(self._streams)])
            while not self._commands.empty():
                self._commands.get_nowait()[2].set_exception(gone)

    def _rank_died(self, exc: BaseException) -> None:
        """A tensor-parallel rank died (on its watcher thread): the engine is dead. The engine
        thread may be stuck in a collective waiting for that rank, so every open stream gets the
        error from here."""
        if self._error is None:
            self._error = exc
        self._wakeup.set()
        self._deliver_all([(rid, exc) for rid in dict(self._streams)])

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams: one wake-up per event loop for all of them, not one per
        request."""
        by_loop: dict = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((request_id, stream[1], item))
        for loop, queued in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, queued)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
                for request_id, _, _ in queued:
                    self._streams.pop(request_id, None)

    def _open(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None, stream
    ) -> None:
        self.engine.add_request(request_id, prompt, params)  # raises for a request_id still in use
        self._streams[request_id] = stream

    def _close(self, request_id: str, stream) -> None:
        """The reader left: drop its stream and abort what is left of its request (not a newer
        one's)."""
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
            self.engine.abort(request_id)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        if out is not None:
            self._deliver(request_id, out)

    # ---- the public API
    # ------------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        if params is not None and params.structured_outputs is not None:
            # Compiled on the grammar engine's threads while this request waits, never on the
            # engine's step loop; a schema it cannot enforce is refused here (ValueError).
            params.validate()
            grammars = await asyncio.to_thread(lambda: self.engine.grammars)
            await asyncio.wrap_future(grammars.submit(params.structured_outputs))
        queue_: asyncio.Queue = asyncio.Queue()
        stream = (asyncio.get_running_loop(), queue_)
        opened = self._call(self._open, request_id, prompt, params, stream)
        finished = False
        try:
            # Inside the try: a caller cancelled while the open is queued still gets its request
            # closed after it.
            await asyncio.wrap_future(opened)
            while not finished:
                item = await queue_.get()
                while not queue_.empty() and not isinstance(item, BaseException):
                    # outputs are cumulative: a slow reader skips to the newest
                    item = queue_.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if self._error is None and not self._stopped:
                await asyncio.wrap_future(self._call(self._close, request_id, stream))

    async def chat(
        self,
        request_id: str,
        messages: Messages,
        params: SamplingParams | None = None,
        **template_kwargs,
    ) -> AsyncIterator[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so it has no chat template")
        ids = self.tokenizer.encode_chat(messages, **template_kwargs)
        async for out in self.generate(request_id, ids, params):
            yield out

    async def add_eos_token_ids(self, token_ids: list[int]) -> None:
        """EngineCore.add_eos_token_ids, between two steps."""
        await asyncio.wrap_future(self._call(self.engine.add_eos_token_ids, list(token_ids)))

    async def abort(self, request_id: str) -> None:
        """End the request (its stream gets a final output with finish_reason "abort"); blocks are
        free on return."""
        await asyncio.wrap_future(self._call(self._abort, request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        # Tensor parallelism: the other ranks stop.
        self.engine.shutdown(idle=not self._thread.is_alive())


def _put_all(items: list) -> None:
    """On the caller's event loop: queue each (request_id, queue, output) of one step."""
    for _, q, item in items:
        q.put_nowait(item)
