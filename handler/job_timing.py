"""When a request waited and started: an engine wrapper that notes each request's first engine step
and first token, and the small `metrics` block a RunPod job's final output carries (queue wait,
capacity, the worker's cold start).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

# The job the current task serves; asyncio tasks copy it, so the OpenAI routes' per-prompt tasks see
# their job.
_CURRENT_JOB: ContextVar["JobTiming | None"] = ContextVar("coldbrew_job_timing", default=None)


@dataclass
class JobTiming:
    """Wall-clock times (time.time(), as the engine's RequestMetrics) of one job's milestones."""

    # the RunPod SDK handed the job to the handler
    received: float = field(default_factory=time.time)
    # the engine was loaded (at once unless the job came during the cold start)
    engine_ready: float | None = None
    # the engine first ran a step for one of the job's requests
    first_scheduled: float | None = None
    first_token: float | None = None

    def note(self, request_metrics) -> None:
        """Take the earliest start and first token over the job's engine requests (n samples,
        batched prompts)."""
        if request_metrics is None:
            return
        scheduled, token = request_metrics.first_scheduled_time, request_metrics.first_token_time
        if scheduled is not None and (
            self.first_scheduled is None or scheduled < self.first_scheduled
        ):
            self.first_scheduled = scheduled
        if token is not None and (self.first_token is None or token < self.first_token):
            self.first_token = token

    @property
    def queue_wait_s(self) -> float | None:
        """Handler start to the first engine step: the wait for the engine to load plus the engine's
        own queue."""
        end = self.first_scheduled if self.first_scheduled is not None else self.engine_ready
        return None if end is None else max(0.0, end - self.received)

    @contextlib.contextmanager
    def current(self):
        """Make this the job of the running task (and of the tasks it starts) for the duration."""
        token = _CURRENT_JOB.set(self)
        try:
            yield self
        finally:
            with contextlib.suppress(ValueError):  # an async generator closed from another context
                _CURRENT_JOB.reset(token)


def job_metrics(timing: JobTiming, capacity: int | None, cold_start: dict[str, float]) -> dict:
    """The `metrics` block of a job's final output (seconds, rounded to the millisecond)."""

    def s(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    phases = dict(cold_start)
    total = phases.get("total")
    if total is not None:
        total += phases.get("before_boot", 0.0)  # process start to ready
    return {
        "queue_wait_s": s(timing.queue_wait_s),
        "engine_wait_s": s(
            None if timing.engine_ready is None else max(0.0, timing.engine_ready - timing.received)
        ),
        "time_to_first_token_s": s(
            None if timing.first_token is None else timing.first_token - timing.received
        ),
        "capacity_requests": capacity,
        "cold_start_s": s(total),
        "cold_start_phases": {k: s(v) for k, v in phases.items() if k != "total"},
    }


class TimedEngine:
    """The AsyncLLM as request code sees it: every stream passes through unchanged while the
    request's engine timing is noted on its job (given, or the running task's) and its own queue
    wait goes to `on_queue_wait`."""

    def __init__(
        self,
        engine,
        timing: JobTiming | None = None,
        on_queue_wait: Callable[[float], None] | None = None,
    ):
        self._engine = engine
        self._timing = timing
        self._on_queue_wait = on_queue_wait

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, request_id: str, prompt, params=None) -> AsyncIterator:
        return self._timed(
            self._engine.generate(request_id, prompt, params), self._timing or _CURRENT_JOB.get()
        )

    def chat(self, request_id: str, messages, params=None, **template_kwargs) -> AsyncIterator:
        return self._timed(
            self._engine.chat(request_id, messages, params, **template_kwargs),
            self._timing or _CURRENT_JOB.get(),
        )

    async def _timed(self, stream: AsyncIterator, timing: JobTiming | None) -> AsyncIterator:
        waited = False
        try:
            async for out in stream:
                m = getattr(out, "metrics", None)
                if timing is not None:
                    timing.note(m)
                if not waited and m is not None and m.first_scheduled_time is not None:
                    waited = True
                    if self._on_queue_wait is not None:
                        self._on_queue_wait(max(0.0, m.first_scheduled_time - m.arrival_time))
                yield out
        finally:
            await stream.aclose()
