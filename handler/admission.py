"""Admission for the RunPod SDK: how many jobs to hold (free KV capacity, up to MAX_CONCURRENCY),
and the exits: SIGTERM drains within a grace period then exits 0; a fatal engine error fails the
jobs in flight and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from handler.metrics import SEED_REQUEST_TOKENS, next_typical_tokens, sustainable_requests

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0  # in-flight jobs get this long after SIGTERM before they are aborted
# after a fatal error or the drain deadline: the longest wait for results to be posted
EXIT_WAIT_S = 10.0


@dataclass
class Ticket:
    """One job in flight: set `abort` (with a reason) to end it."""

    job_id: str
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""


class Admission:
    """Decides the SDK's concurrency and owns the worker's shutdown paths (drain on SIGTERM, exit on
    fatal)."""

    def __init__(
        self,
        max_concurrency: int,
        boot,
        *,
        grace_s: float = DRAIN_GRACE_S,
        exit_wait_s: float = EXIT_WAIT_S,
        exit_fn: Callable[[int], None] = os._exit,
        occupancy: Callable[[], int],
    ):
        self.max_concurrency = max_concurrency
        self.boot = boot
        self.grace_s = grace_s
        self.exit_wait_s = exit_wait_s
        self._exit = exit_fn
        self._occupancy = occupancy
        self.tickets: dict[str, Ticket] = {}
        self.draining = False
        self.fatal_error: BaseException | None = None
        self.typical_tokens = float(SEED_REQUEST_TOKENS)
        self._signals_installed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exiting = threading.Event()
        self._drain_deadline = float("inf")

    # ---- jobs in flight --------------------------------------------------------------------------
    @contextlib.contextmanager
    def track(self, job_id: str) -> Iterator[Ticket]:
        self._loop = asyncio.get_running_loop()
        ticket = Ticket(job_id)
        if self.draining and self._drain_deadline_passed():
            ticket.reason = "the worker is shutting down (SIGTERM)"
            ticket.abort.set()
        self.tickets[job_id] = ticket
        try:
            yield ticket
        finally:
            if self.tickets.get(job_id) is ticket:
                del self.tickets[job_id]

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """A finished request's size: the typical request admission plans for is their moving
        average."""
        self.typical_tokens = next_typical_tokens(self.typical_tokens, prompt_tokens, output_tokens)

    def capacity(self) -> int | None:
        """Concurrent requests this worker sustains now: the jobs it holds plus as many typical
        requests as the free KV blocks hold, within [1, MAX_CONCURRENCY]; None until the engine is
        up."""
        engine = self.boot.engine_now()
        if engine is None:
            return None
        core = engine.engine
        return sustainable_requests(
            engine.stats_nowait().num_free_blocks,
            self._occupancy(),
            self.typical_tokens,
            core.args.block_size,
            core.context_limit,
            self.max_concurrency,
        )

    def abort_all(self, reason: str) -> None:
        for ticket in list(self.tickets.values()):
            ticket.reason = reason
            ticket.abort.set()

    # ---- the SDK's concurrency -------------------------------------------------------------------
    def concurrency_modifier(self, current: int) -> int:
        """How many jobs this worker holds at once. The SDK calls this before each job-take, in its
        event loop.

        Until the engine is up: MAX_CONCURRENCY (taken jobs wait for it). Once up: the jobs held
        plus as many more typical requests as the free KV blocks hold, within [1, MAX_CONCURRENCY].
        The SDK stops taking jobs until it is idle whenever the value changes, so it moves only when
        it must: down when the cache can't take one more typical request or the room is half of what
        was allowed (as after start-up), up when idle or when the room has grown by a quarter."""
        self._install_signal_chain()
        # the SDK calls this in its event loop; the drain timer needs it
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        if self.draining or self.fatal_error is not None:
            return max(1, current)
        engine = self.boot.engine_now()
        if engine is None:
            return self.max_concurrency
        free_blocks = engine.stats_nowait().num_free_blocks
        core = engine.engine
        typical_blocks = max(
            1, -(-int(min(self.typical_tokens, core.context_limit)) // core.args.block_size)
        )
        held = self._occupancy()
        target = sustainable_requests(
            free_blocks,
            held,
            self.typical_tokens,
            core.args.block_size,
            core.context_limit,
            self.max_concurrency,
        )
        if target < current and (free_blocks < typical_blocks or 2 * target <= current):
            return target
        if target > current and (held == 0 or target >= 1.25 * current + 1):
            return target
        return current

    # ---- shutdown --------------------------------------------------------------------------------
    def drain_on_sigterm(self, then: Callable[[], None] | None = None) -> None:
        """From now on a SIGTERM drains (no job held: that exits 0 at once), then calls `then`
        (the SDK's process is told: it stops taking jobs). An SDK in this interpreter installs its
        own handler when its loop starts; the first concurrency_modifier call chains ours in front
        of it again."""

        def on_sigterm(signum, frame) -> None:
            self.begin_drain()
            if then is not None:
                then()

        signal.signal(signal.SIGTERM, on_sigterm)

    def _install_signal_chain(self) -> None:
        """Put our SIGTERM handler in front of the SDK's (which stops job-taking) once its loop
        runs."""
        if self._signals_installed or threading.current_thread() is not threading.main_thread():
            return
        self._signals_installed = True
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            self.begin_drain()
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _drain_deadline_passed(self) -> bool:
        return time.monotonic() >= self._drain_deadline

    def begin_drain(self) -> None:
        """No new work; jobs in flight finish or are aborted after grace_s; then the process exits
        with 0."""
        if self.draining:
            return
        self.draining = True
        self._drain_deadline = time.monotonic() + self.grace_s
        log.info(
            "SIGTERM: draining %d job(s) in flight (grace %.0fs)", len(self.tickets), self.grace_s
        )
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(
                self._loop.call_later,
                self.grace_s,
                self.abort_all,
                "the worker is shutting down (SIGTERM) and the request did not finish within "
                f"{self.grace_s:.0f}s",
            )
        threading.Thread(
            target=self._exit_when_idle,
            args=(0, self.grace_s + self.exit_wait_s),
            name="coldbrew-drain",
            daemon=True,
        ).start()

    def fatal(self, exc: BaseException) -> None:
        """The engine is dead (a CUDA fault, ...): fail what is in flight and exit 1 once their
        results are out."""
        if self.fatal_error is not None:
            return
        self.fatal_error = exc
        log.error(
            "fatal engine error, failing %d job(s) in flight and exiting: %s",
            len(self.tickets),
            exc,
        )
        self.abort_all(f"the engine failed ({type(exc).__name__}); the worker restarts")
        threading.Thread(
            target=self._exit_when_idle,
            args=(1, self.exit_wait_s),
            name="coldbrew-fatal",
            daemon=True,
        ).start()

    def _exit_when_idle(self, code: int, limit_s: float) -> None:
        """Exit with `code` once no job is held (its result posted) or after limit_s, whichever
        comes first."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and (self.tickets or self._occupancy() > 0):
            time.sleep(0.05)
        # the SDK removes a job just after posting its result; let the post's connection close
        time.sleep(0.2)
        if self._exiting.is_set():
            return
        self._exiting.set()
        log.info("exiting with status %d", code)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self._exit(code)
