"""The event loop of the trace simulator: one trace, one worker model, one cold-start time, one
autoscaler.

Arrivals and completions are events; the fleet acts every second; billing is per worker, start to
stop.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from scaling.policy import Observation
from scaling.sim.traces import Trace
from scaling.sim.worker_model import WorkerModel

# time constant of the arrival-rate EWMA the controllers see (bias-corrected while young)
RATE_TAU_S = 10.0
SERVICE_EWMA = 0.05  # weight of each completed request in the mean-service EWMA
GAP_HISTORY = 64  # idle gaps the controllers see


def arrival_rate(rate: float, rate_t: float, now: float, first: float) -> float:
    """The EWMA of arrivals (per second) at `now`, divided by the weight it has had time to gather
    since the first arrival, so that a burst into an empty endpoint is not read as a trickle."""
    if now <= first:
        return rate
    return rate * math.exp(-(now - rate_t) / RATE_TAU_S) / -math.expm1(-(now - first) / RATE_TAU_S)


class _Worker:
    __slots__ = (
        "wid",
        "start",
        "ready_at",
        "stop",
        "ready",
        "load",
        "busy_since",
        "busy",
        "idle_since",
        "idle",
    )

    def __init__(self, wid: int, start: float, ready_at: float):
        self.wid, self.start, self.ready_at, self.stop = wid, start, ready_at, math.nan
        self.ready, self.load = False, 0
        self.busy_since = self.idle_since = math.nan
        self.busy = self.idle = 0.0


@dataclass
class RunResult:
    """Per-request arrays (trace order) and per-worker billing of one simulated run."""

    dispatch_s: np.ndarray  # when each request got a slot
    finish_s: np.ndarray  # when it left its slot
    ttft_s: np.ndarray  # arrival to first token
    queue_wait_s: np.ndarray
    worker: np.ndarray  # index of the worker that served it
    completions: np.ndarray  # how many times each request completed
    boot_s: float
    busy_s: float
    idle_s: float
    billed_s: float
    cold_starts: int
    end_s: float
    peak_workers: int

    def metrics(self) -> dict:
        ttft, wait = self.ttft_s, self.queue_wait_s
        return {
            "gpu_s": self.billed_s,
            "boot_s": self.boot_s,
            "busy_s": self.busy_s,
            "idle_s": self.idle_s,
            "queue_wait_p50_s": float(np.percentile(wait, 50)),
            "queue_wait_p99_s": float(np.percentile(wait, 99)),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "slo_2s": float(np.mean(ttft <= 2.0)),
            "slo_5s": float(np.mean(ttft <= 5.0)),
            "cold_starts": self.cold_starts,
            "peak_workers": self.peak_workers,
            "requests": int(len(ttft)),
        }


def simulate_run(
    trace: Trace,
    model: WorkerModel,
    controller,
    cold_start_s: float,
    initial_workers: int = 0,
    tick_s: float = 1.0,
    max_overrun_s: float = 36_000.0,
) -> RunResult:
    """Replay `trace` under `controller` (callable (now, Observation) -> (desired, keep_alive_s),
    with `poll_s`).

    Every second the fleet applies the controller's last answer (polled every `poll_s`): start
    workers up to `desired`; stop idle workers beyond it once idle for `keep_alive_s`, longest-idle
    first. Requests wait in one FIFO queue and go to the ready worker with the most requests that
    still has a free slot. A worker is billed from its start to its stop: boot, then busy (any
    request in it) or idle.

    initial_workers: workers already ready (idle) at time 0, billed from 0, not counted as cold
    starts: the endpoint was serving before the trace's sample begins."""
    arrival = trace.arrival_s.tolist()
    ctx = trace.context_tokens.tolist()
    gen = trace.generated_tokens.tolist()
    n = len(arrival)
    cap = model.capacity
    ttft_tab = (model.ttft_s / model.reference_context).tolist()
    rate_tab = model.decode_tok_s.tolist()
    dispatch = [math.nan] * n
    ttft = [math.nan] * n
    who = [-1] * n
    done = [0] * n
    finish = [math.nan] * n

    workers: list[_Worker] = []
    active: list[int] = []  # ids of workers not stopped
    # (time, kind 0=completion 1=ready, worker id, request)
    events: list[tuple[float, int, int, int]] = []
    queue: deque[int] = deque()
    in_progress = 0
    rate, rate_t = 0.0, 0.0
    service = Observation.__dataclass_fields__["mean_service_s"].default
    gaps: deque[float] = deque(maxlen=GAP_HISTORY)
    empty_since = math.nan  # nan: never had a request yet
    desired, keep_alive = 0, 0.0
    poll = float(controller.poll_s)
    next_poll = 0.0
    next_tick = 0.0
    for _ in range(initial_workers):
        w = _Worker(len(workers), 0.0, 0.0)
        w.ready, w.idle_since = True, 0.0
        workers.append(w)
        active.append(w.wid)
    peak = len(active)
    ai = 0
    end = 0.0
    limit = (arrival[-1] if n else 0.0) + max_overrun_s

    def dispatch_queue(now: float) -> None:
        nonlocal in_progress
        while queue:
            best, best_load = None, -1
            for wid in active:
                w = workers[wid]
                if w.ready and best_load < w.load < cap:
                    best, best_load = w, w.load
            if best is None:
                return
            i = queue.popleft()
            c = best.load + 1  # WorkerModel.service_s, inlined: this loop runs once per request
            first = ttft_tab[c] * (ctx[i] if ctx[i] > 0 else 1)
            svc = first + (gen[i] - 1 if gen[i] > 1 else 0) / rate_tab[c]
            dispatch[i] = now
            ttft[i] = now - arrival[i] + first
            who[i] = best.wid
            if c == 1:
                best.busy_since = now
                best.idle += now - best.idle_since
            best.load = c
            in_progress += 1
            heapq.heappush(events, (now + svc, 0, best.wid, i))

    while True:
        ta = arrival[ai] if ai < n else math.inf
        te = events[0][0] if events else math.inf
        if ai == n and not queue and in_progress == 0:
            break
        if te <= ta and te <= next_tick:
            now, kind, wid, i = heapq.heappop(events)
            w = workers[wid]
            if kind == 1:
                if not math.isnan(w.stop):
                    continue
                w.ready, w.idle_since = True, now
            else:
                w.load -= 1
                in_progress -= 1
                done[i] += 1
                finish[i] = now
                service += SERVICE_EWMA * ((now - dispatch[i]) - service)
                if w.load == 0:
                    w.busy += now - w.busy_since
                    w.idle_since = now
                if in_progress == 0 and not queue:
                    empty_since = now
                    end = now
            dispatch_queue(now)
        elif ta <= next_tick:
            now = ta
            i = ai
            ai += 1
            rate = rate * math.exp(-(now - rate_t) / RATE_TAU_S) + 1.0 / RATE_TAU_S
            rate_t = now
            if not queue and in_progress == 0 and not math.isnan(empty_since):
                gaps.append(now - empty_since)
            queue.append(i)
            dispatch_queue(now)
        else:
            now = next_tick
            next_tick += tick_s
            if now > limit:
                raise RuntimeError(
                    f"{controller!r} left {len(queue)} requests waiting past {limit:.0f}s"
                )
            ready = sum(1 for wid in active if workers[wid].ready)
            booting = len(active) - ready
            if now >= next_poll:
                next_poll += poll
                idle_ready = sum(
                    1 for wid in active if workers[wid].ready and workers[wid].load == 0
                )
                empty = not queue and in_progress == 0
                idle_for = (now - empty_since) if empty and not math.isnan(empty_since) else 0.0
                obs = Observation(
                    in_queue=len(queue),
                    in_progress=in_progress,
                    workers_ready=ready,
                    workers_booting=booting,
                    workers_idle=idle_ready,
                    capacity_per_worker=float(cap),
                    arrival_rate=arrival_rate(rate, rate_t, now, arrival[0] if n else 0.0),
                    mean_service_s=service,
                    cold_start_s=cold_start_s,
                    oldest_wait_s=(now - arrival[queue[0]]) if queue else 0.0,
                    idle_gaps_s=tuple(gaps),
                    idle_for_s=idle_for,
                )
                desired, keep_alive = controller(now, obs)
            total = len(active)
            if desired > total:
                for _ in range(desired - total):
                    w = _Worker(len(workers), now, now + cold_start_s)
                    workers.append(w)
                    active.append(w.wid)
                    heapq.heappush(events, (w.ready_at, 1, w.wid, -1))
                peak = max(peak, len(active))
            elif desired < total:
                idle = [
                    wid
                    for wid in active
                    if workers[wid].ready
                    and workers[wid].load == 0
                    and now - workers[wid].idle_since >= keep_alive
                ]
                idle.sort(key=lambda wid: workers[wid].idle_since)
                for wid in idle[: total - desired]:
                    w = workers[wid]
                    w.stop = now
                    w.idle += now - w.idle_since
                    active.remove(wid)

    end = max(end, arrival[-1] if n else 0.0)
    for wid in active:
        w = workers[wid]
        w.stop = end
        if w.ready:
            if w.load == 0:
                w.idle += end - w.idle_since
            else:
                w.busy += end - w.busy_since
    boot = sum(min(w.stop, w.ready_at) - w.start for w in workers)
    busy = sum(w.busy for w in workers)
    idle = sum(w.idle for w in workers)
    billed = sum(w.stop - w.start for w in workers)
    t_arr = np.asarray(arrival)
    d = np.asarray(dispatch)
    return RunResult(
        dispatch_s=d,
        finish_s=np.asarray(finish),
        ttft_s=np.asarray(ttft),
        queue_wait_s=d - t_arr,
        worker=np.asarray(who),
        completions=np.asarray(done),
        boot_s=boot,
        busy_s=busy,
        idle_s=idle,
        billed_s=billed,
        cold_starts=len(workers) - initial_workers,
        end_s=end,
        peak_workers=peak,
    )
