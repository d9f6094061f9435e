"""The controller's loop: each poll reads the endpoint's /health, asks scaling.policy.decide() for
the workers to hold and, when that changes the endpoint, PATCHes its workersMin (and, if asked,
workersMax and idleTimeout) through scaling.runpod_api.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from scaling.controller.meter import ArrivalMeter
from scaling.policy import Decision, Observation, PolicyConfig, decide
from scaling.runpod_api import EndpointHealth, RunPodApi, RunPodApiError

log = logging.getLogger("scaling.controller")

RUNPOD_IDLE_TIMEOUT_RANGE = (1, 3600)  # seconds RunPod accepts for an endpoint's idleTimeout


def observation(
    health: EndpointHealth,
    meter: ArrivalMeter,
    now: float,
    *,
    capacity: float,
    cold_start_s: float,
    mean_service_s: float,
) -> Observation:
    """The policy's view of one /health answer: ready workers are the idle and the running ones,
    booting workers are those RunPod reports initializing."""
    return Observation(
        in_queue=health.in_queue,
        in_progress=health.in_progress,
        workers_ready=health.workers_idle + health.workers_running,
        workers_booting=health.workers_initializing,
        workers_idle=health.workers_idle,
        capacity_per_worker=capacity,
        arrival_rate=meter.rate,
        mean_service_s=mean_service_s,
        cold_start_s=cold_start_s,
        oldest_wait_s=meter.oldest_wait_s,
        idle_gaps_s=tuple(meter.gaps),
        idle_for_s=meter.idle_for(now),
    )


def update_body(
    decision: Decision, config: PolicyConfig, *, apply_max: bool, apply_idle_timeout: bool
) -> dict:
    """The EndpointUpdateInput fields that apply a decision."""
    body = {"workersMin": int(decision.desired_workers)}
    if apply_max:
        body["workersMax"] = int(config.max_workers)
    if apply_idle_timeout:
        low, high = RUNPOD_IDLE_TIMEOUT_RANGE
        body["idleTimeout"] = int(min(high, max(low, round(decision.keep_alive_s))))
    return body


class Controller:
    """Poll, decide, apply: one `step()` per interval. Sends an update only when it would change the
    endpoint (`current`: its settings as read at start)."""

    def __init__(
        self,
        api: RunPodApi,
        config: PolicyConfig,
        *,
        capacity: float,
        cold_start_s: float,
        mean_service_s: float = 10.0,
        rate_window_s: float = 60.0,
        dry_run: bool = False,
        apply_max: bool = False,
        apply_idle_timeout: bool = False,
        out: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
        current: dict | None = None,
    ):
        self.api = api
        self.config = config
        self.capacity = capacity
        self.cold_start_s = cold_start_s
        self.mean_service_s = mean_service_s
        self.meter = ArrivalMeter(rate_window_s)
        self.dry_run = dry_run
        self.apply_max = apply_max
        self.apply_idle_timeout = apply_idle_timeout
        self.out = out
        self.clock = clock
        self.current = dict(current or {})  # the endpoint's settings as last read or set

    def step(self) -> tuple[Decision, dict, str]:
        """One poll: the decision, the update body, and what was done with it (dry-run / applied /
        unchanged)."""
        health = self.api.health()
        now = self.clock()
        arrived = self.meter.update(now, health)
        obs = observation(
            health,
            self.meter,
            now,
            capacity=self.capacity,
            cold_start_s=self.cold_start_s,
            mean_service_s=self.mean_service_s,
        )
        decision = decide(obs, self.config)
        body = update_body(
            decision,
            self.config,
            apply_max=self.apply_max,
            apply_idle_timeout=self.apply_idle_timeout,
        )
        if self.dry_run:
            action = "dry-run"
        elif all(self.current.get(k) == v for k, v in body.items()):
            action = "unchanged"
        else:
            self.api.update_endpoint(**body)
            self.current.update(body)
            action = "applied"
        self.out(
            f"{time.strftime('%H:%M:%S')} queue={health.in_queue} "
            f"running={health.in_progress} arrived={arrived} rate={self.meter.rate:.3f}/s "
            f"workers ready={obs.workers_ready} booting={obs.workers_booting} "
            f"idle={obs.workers_idle} -> {json.dumps(body, sort_keys=True)} "
            f"keep_alive={decision.keep_alive_s:.0f}s [{action}] {' '.join(decision.reasons)}"
        )
        return decision, body, action

    def run(self, interval_s: float, iterations: int = 0, max_failures: int = 3) -> int:
        """Step every interval_s until `iterations` steps (0: forever). A refused key or an unknown
        endpoint stops at once; an unreachable API stops after max_failures polls in a row. Returns
        the exit status."""
        failures, done = 0, 0
        while True:
            started = self.clock()
            try:
                self.step()
                failures = 0
            except RunPodApiError as exc:
                if exc.status in (400, 401, 403, 404):
                    log.error("%s", exc)
                    return 1
                failures += 1
                log.warning("%s (%d/%d)", exc, failures, max_failures)
                if failures >= max_failures:
                    log.error("giving up after %d failed polls in a row", failures)
                    return 1
            done += 1
            if iterations and done >= iterations:
                return 0
            time.sleep(max(0.0, interval_s - (self.clock() - started)))
