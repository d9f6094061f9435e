"""The autoscalers the simulator compares: RunPod's two scaler types, KEDA-like, Knative-like, a
fixed keep-alive, ours.

Each is a small stateful controller: (now, Observation) every `poll_s` -> (desired workers, idle
keep-alive).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from scaling.policy import Observation, PolicyConfig, decide


@dataclass
class RunPodQueueDelay:
    """RunPod QUEUE_DELAY: the first request into an empty endpoint starts a worker; after that one
    more worker per poll while a request has waited longer than `delay_s`. Idle workers go after
    RunPod's idle timeout (5 s)."""

    delay_s: float = 4.0
    idle_timeout_s: float = 5.0
    max_workers: int = 8
    poll_s: float = 1.0

    def __call__(self, now: float, obs: Observation) -> tuple[int, float]:
        total = obs.workers_ready + obs.workers_booting
        busy = obs.workers_ready - obs.workers_idle + obs.workers_booting
        if obs.in_queue > 0 and total == 0:
            want = 1
        elif obs.in_queue > 0 and obs.oldest_wait_s > self.delay_s:
            want = total + 1
        else:
            want = busy
        return min(want, self.max_workers), self.idle_timeout_s


@dataclass
class RunPodRequestCount:
    """RunPod REQUEST_COUNT: ceil((in queue + in progress) / requests_per_worker) workers; idle
    timeout 5 s."""

    requests_per_worker: float = 4.0
    idle_timeout_s: float = 5.0
    max_workers: int = 8
    poll_s: float = 1.0

    def __call__(self, now: float, obs: Observation) -> tuple[int, float]:
        want = math.ceil((obs.in_queue + obs.in_progress) / self.requests_per_worker)
        return min(want, self.max_workers), self.idle_timeout_s


@dataclass
class KedaLike:
    """KEDA on a queue length: every 30 s, ceil(backlog / target) with backlog = in queue + in
    progress; the HPA keeps the highest recommendation of the last 300 s; to zero only after 300 s
    (cooldown) with no backlog."""

    target: float = 32.0
    poll_s: float = 30.0
    cooldown_s: float = 300.0
    stabilization_s: float = 300.0
    max_workers: int = 8
    _history: deque = field(default_factory=deque)
    _last_active: float = -math.inf

    def __call__(self, now: float, obs: Observation) -> tuple[int, float]:
        backlog = obs.in_queue + obs.in_progress
        if backlog > 0:
            self._last_active = now
        raw = math.ceil(backlog / self.target)
        self._history.append((now, raw))
        while self._history and self._history[0][0] < now - self.stabilization_s:
            self._history.popleft()
        want = max(r for _, r in self._history)
        if want == 0 and now - self._last_active < self.cooldown_s:
            want = 1  # KEDA scales 1 -> 0 only after the cooldown
        return min(want, self.max_workers), 0.0


@dataclass
class KnativeLike:
    """Knative KPA: concurrency (in queue + in progress) averaged over a 60 s stable and a 6 s panic
    window, divided by target * 0.7; panic (never scale down, follow the panic window) while the
    panic count is at least twice the ready pods; to zero once the stable window has seen no request
    plus a 30 s grace period. Polls every 2 s."""

    target: float = 100.0
    utilization: float = 0.7
    stable_s: float = 60.0
    panic_s: float = 6.0
    grace_s: float = 30.0
    poll_s: float = 2.0
    max_workers: int = 8
    _samples: deque = field(default_factory=deque)
    _panic_until: float = -math.inf
    _want: int = 0
    _zero_since: float = math.inf

    def __call__(self, now: float, obs: Observation) -> tuple[int, float]:
        conc = obs.in_queue + obs.in_progress
        self._samples.append((now, conc))
        while self._samples and self._samples[0][0] <= now - self.stable_s:
            self._samples.popleft()
        stable = sum(c for _, c in self._samples) / len(self._samples)
        recent = [c for t, c in self._samples if t > now - self.panic_s]
        panic_avg = sum(recent) / len(recent)
        per_pod = self.target * self.utilization
        want_stable = math.ceil(stable / per_pod)
        want_panic = math.ceil(panic_avg / per_pod)
        if want_panic >= 2 * max(obs.workers_ready, 1) and conc > 0:
            self._panic_until = now + self.stable_s
        if now < self._panic_until:
            want = max(want_panic, self._want)
        else:
            want = want_stable
        if conc > 0 and want == 0:
            want = 1  # the activator wakes a scaled-to-zero revision at once
        if want == 0 and self._want > 0:  # grace period before the last pod goes
            self._zero_since = min(self._zero_since, now)
            if now - self._zero_since < self.grace_s:
                want = self._want
        else:
            self._zero_since = math.inf
        self._want = min(want, self.max_workers)
        return self._want, 0.0


@dataclass
class FixedKeepAlive:
    """A Lambda/Modal-style fleet: enough workers for the requests present, each kept for a fixed
    time once idle."""

    keep_alive_s: float = 600.0
    max_workers: int = 8
    poll_s: float = 1.0

    def __call__(self, now: float, obs: Observation) -> tuple[int, float]:
        want = math.ceil((obs.in_queue + obs.in_progress) / max(obs.capacity_per_worker, 1e-9))
        return min(want, self.max_workers), self.keep_alive_s


@dataclass
class Ours:
    """scaling.policy.decide, polled every second."""

    config: PolicyConfig = PolicyConfig()
    poll_s: float = 1.0

    def __call__(self, now: float, obs: Observation) -> tuple[int, float]:
        d = decide(obs, self.config)
        return d.desired_workers, d.keep_alive_s


# name -> (knob, default, sweep values, factory(knob value, max_workers) -> controller)
POLICIES = {
    "runpod-queue-delay": (
        "delay_s",
        4.0,
        (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0),
        lambda v, m: RunPodQueueDelay(delay_s=v, max_workers=m),
    ),
    "runpod-request-count": (
        "requests_per_worker",
        4.0,
        (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 96.0, 128.0),
        lambda v, m: RunPodRequestCount(requests_per_worker=v, max_workers=m),
    ),
    "keda": (
        "target",
        32.0,
        (4.0, 8.0, 16.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0),
        lambda v, m: KedaLike(target=v, max_workers=m),
    ),
    "knative": (
        "target",
        100.0,
        (10.0, 25.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0),
        lambda v, m: KnativeLike(target=v, max_workers=m),
    ),
    "keep-alive": (
        "keep_alive_s",
        600.0,
        (15.0, 30.0, 60.0, 120.0, 180.0, 300.0, 450.0, 600.0, 900.0, 1200.0),
        lambda v, m: FixedKeepAlive(keep_alive_s=v, max_workers=m),
    ),
    # two knobs, each its own concern: wait_cost_weight (keep-warm through idle gaps) x
    # target_utilization (headroom)
    "ours": (
        "wait_cost_weight/target_utilization",
        (PolicyConfig().wait_cost_weight, PolicyConfig().target_utilization),
        tuple(
            (w, u)
            for u in (0.85, 0.5, 0.25)
            for w in (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 512.0)
        ),
        lambda v, m: Ours(
            PolicyConfig(wait_cost_weight=v[0], target_utilization=v[1], max_workers=m)
        ),
    ),
}
