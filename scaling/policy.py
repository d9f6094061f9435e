"""The scaling policy: a pure function from what an endpoint looks like now to how many workers it
should have.

No I/O, no clocks, no globals: the controller, the local endpoint and the simulator all call
`decide` with an `Observation` and act on the `Decision`. The formula is documented in `decide` and
in docs/scaling.md.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Observation:
    """What the caller sees at one instant. Times in seconds, rates per second."""

    in_queue: int  # requests waiting for a worker slot
    in_progress: int  # requests running on workers
    workers_ready: int  # workers that take jobs now (busy or idle)
    workers_booting: int  # workers started but not ready yet
    workers_idle: int  # ready workers running no request
    capacity_per_worker: float  # concurrent requests one worker sustains (from its free KV blocks)
    arrival_rate: float = 0.0  # recent arrivals, requests/s (e.g. an EWMA)
    mean_service_s: float = 10.0  # mean time one request holds a slot
    cold_start_s: float = 30.0  # measured process start to ready
    oldest_wait_s: float = 0.0  # how long the oldest queued request has waited
    idle_gaps_s: tuple[float, ...] = ()  # recent lengths of gaps with no request at all
    idle_for_s: float = 0.0  # how long the endpoint has had no request at all (0 while it has any)


@dataclass(frozen=True)
class PolicyConfig:
    """The knobs a user sets; defaults suit a chat endpoint."""

    latency_budget_s: float = 2.0  # queue wait we accept before adding a worker
    min_workers: int = 0
    max_workers: int = 8
    target_utilization: float = 0.85  # fraction of a worker's slots we plan to fill
    max_keep_alive_s: float = 1800.0
    # GPU-seconds we would pay to spare the first request after an idle gap one second of cold-start
    # wait: 0 keeps a worker warm as long as pure cost says (one cold start), larger values keep it
    # through longer gaps.
    wait_cost_weight: float = 8.0
    # idle gaps needed before the history overrides the one-cold-start keep-alive
    min_gap_history: int = 4

    def __post_init__(self) -> None:
        checks = (
            ("latency_budget_s", self.latency_budget_s >= 0, ">= 0"),
            ("min_workers", self.min_workers >= 0, ">= 0"),
            ("max_workers", self.max_workers >= max(self.min_workers, 1), ">= max(min_workers, 1)"),
            ("target_utilization", 0 < self.target_utilization <= 1, "in (0, 1]"),
            ("max_keep_alive_s", self.max_keep_alive_s >= 0, ">= 0"),
            ("wait_cost_weight", self.wait_cost_weight >= 0, ">= 0"),
            ("min_gap_history", self.min_gap_history >= 1, ">= 1"),
        )
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"{name}: must be {limit}, got {getattr(self, name)!r}")


class IdleGaps:
    """The idle-gap inputs of an Observation from successive looks at an endpoint (the caller passes
    the time): the lengths of recent spells with no request queued or running, and how long the
    current one has lasted. A spell that began before any request was seen has no known start, so it
    ends no gap."""

    def __init__(self, history: int = 32):
        self.gaps: deque[float] = deque(maxlen=history)
        self._idle_since: float | None = None
        self._seen_activity = False

    def observe(self, now: float, active: bool) -> None:
        if active:
            if self._idle_since is not None and self._seen_activity:
                self.gaps.append(now - self._idle_since)
            self._idle_since = None
            self._seen_activity = True
        elif self._idle_since is None:
            self._idle_since = now

    def idle_for(self, now: float) -> float:
        return 0.0 if self._idle_since is None else now - self._idle_since


@dataclass(frozen=True)
class Decision:
    desired_workers: int  # ready + booting workers the endpoint should have
    keep_alive_s: float  # how long an idle worker beyond desired_workers stays before it is drained
    reasons: tuple[str, ...] = field(default=())
    # how long after the last request the policy keeps one worker warm (in desired_workers)
    keep_warm_s: float = 0.0


@functools.lru_cache(maxsize=4096)  # pure; the gap history changes only when traffic resumes
def keep_warm_horizon(gaps: tuple[float, ...], cold_start_s: float, config: PolicyConfig) -> float:
    """Seconds to keep the last worker warm after traffic stops: ski rental with the idle-gap
    history.

    A cold start costs P = cold_start_s * (1 + wait_cost_weight): the boot we pay for plus the wait
    of whoever arrives into a cold endpoint. Keeping warm for K seconds costs min(gap, K) per gap,
    and P for every gap longer than K. Without enough history K = P (rent until renting has cost
    what buying does: within 2x of the best K in hindsight). With history, K minimises sum(min(g, K)
    + P * [g > K]) over the recent gaps plus one not seen yet, as long as twice the longest seen or
    P, whichever is longer (the next gap beats all n seen with probability 1/(n + 1); without it K
    would sit exactly on the longest gap and every new record would pay a cold start). With history
    K may fall below one cold start (when traffic that stops stays away, the best is to go at once);
    it is at most max_keep_alive_s.
    """
    penalty = cold_start_s * (1.0 + config.wait_cost_weight)
    top = config.max_keep_alive_s
    usable = sorted(g for g in gaps if g >= 0 and math.isfinite(g))
    if len(usable) < config.min_gap_history:
        horizon = penalty
    else:
        usable.append(min(max(2.0 * usable[-1], penalty), top))  # the gap not seen yet
        n = len(usable)
        horizon, best_cost, covered = 0.0, n * penalty, 0.0  # K = 0: every gap pays a cold start
        for j, g in enumerate(usable):  # K = g covers gaps 0..j and cuts the longer ones at g
            covered += g
            cost = covered + (n - 1 - j) * (g + penalty)
            if cost < best_cost:
                horizon, best_cost = g, cost
    return min(max(horizon, cold_start_s if len(usable) < config.min_gap_history else 0.0), top)


def predicted_backlog(obs: Observation) -> float:
    """Requests still queued one cold start from now if no worker is added (a fluid estimate).

    Over the next C = cold_start_s seconds the queue gains arrival_rate * C requests; ready workers
    take them into their free slots and drain workers_ready * capacity / mean_service per second;
    every booting worker is up by then (it started before a worker started now would), takes
    `capacity` of them and drains for about C / 2: capacity on its way.
    """
    cap = max(obs.capacity_per_worker, 0.0)
    free_ready = max(obs.workers_ready * cap - obs.in_progress, 0.0)
    # a booting worker has on average half a cold start to go: it drains for about the second half
    # of the horizon
    draining_workers = obs.workers_ready + 0.5 * obs.workers_booting
    drained = draining_workers * cap / max(obs.mean_service_s, 1e-9) * obs.cold_start_s
    incoming = obs.in_queue + obs.arrival_rate * obs.cold_start_s
    return max(0.0, incoming - free_ready - drained - obs.workers_booting * cap)


def decide(obs: Observation, config: PolicyConfig = PolicyConfig()) -> Decision:
    """Desired workers (ready + booting) and the keep-alive of idle workers beyond them, for one
    observation.

    With s = capacity_per_worker * target_utilization slots planned per worker, S = mean_service_s,
    C = cold_start_s:

    - rate need   N_rate  = ceil(arrival_rate * S / s) while any request is present: the slots that
      the arrival rate keeps busy (Little's law). In a pause the warm floor below decides, not a
      decaying rate estimate.
    - queue need  N_queue: with no worker ready or booting, ceil((in_queue + in_progress) / s) at
      once. Otherwise B = predicted_backlog: the requests still queued one cold start from now
      without a new worker (queue plus arrivals over C, less the ready workers' free slots and
      drain, less every booting worker's slots: capacity on its way). If the newest of them would
      still wait longer than the latency budget, B * S / ((workers_ready + workers_booting) *
      capacity) > latency_budget_s, add ceil(B / s) workers at once. A queue the fleet clears within
      one cold start is not helped by a worker that arrives after it is gone.
    - busy        N_busy  = workers_ready - workers_idle + workers_booting: scale down only by
      draining idle workers; a booting worker is capacity on its way, never cancelled.
    - warm floor  N_warm  = 1 while any worker exists and the endpoint has been idle less than K =
      keep_warm_horizon (ski rental over the idle-gap history; one cold start times 1 +
      wait_cost_weight until there is history); it never starts a worker, only keeps one.

    desired = clamp(max(N_rate, N_queue, N_busy, N_warm), min_workers, max_workers). Workers beyond
    desired are drained once idle for keep_alive_s = K too: the same ski rental for a surplus worker
    (restarting it costs a cold start), which also keeps the fleet from flapping when the rate
    hovers at a worker boundary.
    """
    cap = max(obs.capacity_per_worker, 1e-9)
    slots = cap * config.target_utilization
    service = max(obs.mean_service_s, 0.0)
    present = obs.in_queue + obs.in_progress
    reasons = []

    n_rate = math.ceil(obs.arrival_rate * service / slots - 1e-9) if present > 0 else 0
    n_queue = 0
    fleet = obs.workers_ready + obs.workers_booting
    if obs.in_queue > 0 and fleet == 0:
        n_queue = math.ceil(present / slots)
        reasons.append("queue and no worker")
    elif obs.in_queue > 0:
        backlog = predicted_backlog(obs)
        drain = fleet * cap / max(service, 1e-9)
        if backlog / drain > config.latency_budget_s:
            n_queue = fleet + math.ceil(backlog / slots)
            reasons.append(f"backlog in one cold start {backlog:.0f} > budget")
    n_busy = obs.workers_ready - obs.workers_idle + obs.workers_booting
    horizon = keep_warm_horizon(obs.idle_gaps_s, obs.cold_start_s, config)
    exists = obs.workers_ready + obs.workers_booting > 0
    n_warm = 1 if exists and (present > 0 or obs.idle_for_s < horizon) else 0

    desired = max(n_rate, n_queue, n_busy, n_warm, config.min_workers)
    desired = min(desired, config.max_workers)
    reasons.extend((f"rate={n_rate}", f"queue={n_queue}", f"busy={n_busy}", f"warm={n_warm}"))
    return Decision(
        desired_workers=desired,
        keep_alive_s=horizon,
        reasons=tuple(reasons),
        keep_warm_s=horizon,
    )
