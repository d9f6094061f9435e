"""What the controller reads from successive /health polls of a RunPod endpoint: the arrival rate,
the idle gaps and how long the oldest queued request has waited.
"""

from __future__ import annotations

import math
from collections import deque

from scaling.policy import IdleGaps
from scaling.runpod_api import EndpointHealth

GAP_HISTORY = 32  # idle gaps remembered for the keep-alive


class ArrivalMeter:
    """Arrival rate from successive /health counts: new requests = the growth of completed + failed
    + queued + running between two polls, smoothed by an exponentially weighted moving average over
    `window_s`. Also the lengths of the gaps with no request at all, how long the current one has
    lasted, and how long the oldest queued request has waited (first in, first out: the queue's head
    is request number taken + 1, where taken = seen - in queue; it had arrived by the first poll
    whose count reached that number, so the wait is a lower bound)."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.rate = 0.0
        self.idle = IdleGaps(GAP_HISTORY)
        self._last: tuple[float, int] | None = None
        # (poll time, requests seen by then), oldest first
        self._counts: deque[tuple[float, int]] = deque()
        self.oldest_wait_s = 0.0

    def update(self, now: float, health: EndpointHealth) -> int:
        """Take one poll; returns the requests that arrived since the previous one."""
        seen = health.seen
        arrived = 0
        if self._last is not None:
            last_t, last_seen = self._last
            dt = max(now - last_t, 1e-6)
            # the counts may be windowed by RunPod: a drop is no arrival
            arrived = max(0, seen - last_seen)
            weight = 1.0 - math.exp(-dt / self.window_s)
            self.rate += weight * (arrived / dt - self.rate)
        self._last = (now, seen)
        self._note_queue_head(now, seen, health.in_queue)
        self.idle.observe(now, active=health.in_queue + health.in_progress > 0 or arrived > 0)
        return arrived

    def _note_queue_head(self, now: float, seen: int, in_queue: int) -> None:
        if self._counts and seen < self._counts[-1][1]:
            self._counts.clear()  # the counts went back: what they said before no longer lines up
        self._counts.append((now, seen))
        head = seen - in_queue + 1  # the number of the oldest request still queued
        while len(self._counts) > 1 and self._counts[1][1] < head:
            self._counts.popleft()  # polls from before the head arrived
        arrived_by = next((t for t, n in self._counts if n >= head), now)
        self.oldest_wait_s = now - arrived_by if in_queue > 0 else 0.0

    @property
    def gaps(self) -> deque[float]:
        return self.idle.gaps

    def idle_for(self, now: float) -> float:
        return self.idle.idle_for(now)
