"""The engine side of one OpenAI request: its AsyncLLM streams (one per prompt) merged into one view
of the newest outputs, and the chunk stream a streaming response hands out, which aborts the engine
work when it is closed early. Both can be interrupted (the drain deadline) wherever they wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any


class Interrupted(Exception):
    """Raised where a request waits for the engine once it was interrupted (the drain deadline)."""

    status = 503


class RequestStreams:
    """The engine streams of one API request (one per prompt), merged; the newest cumulative output
    per prompt.

    `start()` returns once every prompt was admitted (an engine refusal raises there, before any
    chunk is sent); `close()` aborts whatever is still running (the engine frees its blocks)."""

    def __init__(self, engine, request_id: str, prompts: list[list[int]], params):
        self.engine = engine
        self.ids = [
            request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))
        ]
        self.prompts = prompts
        self.params = params
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.latest: dict[int, Any] = {}
        self.unfinished = set(range(len(prompts)))

    async def _pump(self, i: int) -> None:
        gen = self.engine.generate(self.ids[i], self.prompts[i], self.params)
        try:
            async for out in gen:
                self.queue.put_nowait((i, out))
        except Exception as exc:
            self.queue.put_nowait((i, exc))
        finally:
            await gen.aclose()

    async def _next(self) -> None:
        """Wait for news, then take everything queued (a slow reader skips to the newest cumulative
        outputs)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for i, item in items:
            if isinstance(item, BaseException):
                raise item
            self.latest[i] = item
            if item.finished:
                self.unfinished.discard(i)

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.prompts))]
        try:
            while len(self.latest) < len(self.prompts):
                await self._next()
        except BaseException:
            await self.close()
            raise

    async def updates(self) -> AsyncIterator[dict[int, Any]]:
        """Yield the latest outputs after each batch of news, the first batch included, until all
        finished."""
        yield self.latest
        while self.unfinished:
            await self._next()
            yield self.latest

    def interrupt(self) -> None:
        """The reader's wait for news raises Interrupted (it closes the streams as on any error)."""
        self.queue.put_nowait((0, Interrupted()))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class ChunkStream:
    """The chunks of a streaming response: an async iterator of dicts. `aclose()` (also before the
    first chunk) aborts what the engine still runs for it; callers must aclose it if they stop early
    (contextlib.aclosing)."""

    def __init__(self, chunks: AsyncIterator[dict], streams: RequestStreams):
        self._chunks = chunks
        self._streams = streams
        self._ended = False
        # called once with the HTTP-like status: 200 done, 4xx/5xx failed, 499 left early
        self.on_end = None

    def __aiter__(self) -> "ChunkStream":
        return self

    async def __anext__(self) -> dict:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            await self._end(200)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # the consumer left (a closed connection, a cancelled job)
            await self._end(499)
            raise
        except (
            BaseException
        ) as e:  # an ApiError carries its HTTP status; anything else is a server error
            await self._end(getattr(e, "status", 500))
            raise

    async def _end(self, status: int) -> None:
        if self._ended:
            return
        self._ended = True
        try:
            await self._chunks.aclose()
            await self._streams.close()
        finally:
            if self.on_end is not None:
                self.on_end(status)

    async def aclose(self) -> None:
        await self._end(499)

    def interrupt(self) -> None:
        """The next (or pending) chunk raises Interrupted instead of waiting for the engine."""
        self._streams.interrupt()

    def mapped(self, convert) -> "ChunkStream":
        """The same request's stream with its chunks turned into others by convert (an async
        generator over these chunks)."""
        return ChunkStream(convert(self._chunks), self._streams)


async def drain(streams: RequestStreams) -> float | None:
    """Run a non-streaming request to its end (closing its streams whatever happens); when its first
    token came."""
    first_token = None
    try:
        async for latest in streams.updates():
            if first_token is None and any(c.token_ids for o in latest.values() for c in o.outputs):
                first_token = time.monotonic()
    finally:
        await streams.close()
    return first_token
