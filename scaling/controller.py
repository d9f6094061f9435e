"""`python -m scaling.controller --endpoint ID`: drives a RunPod endpoint's minimum workers from its queue with the
cold-start-aware policy (scaling.policy); `--dry-run` prints decisions only; `--recommend` prints native settings.

Each poll reads `GET https://api.runpod.ai/v2/{id}/health` and, when the decision changes, sends
`PATCH https://rest.runpod.io/v1/endpoints/{id}` with `{"workersMin": N}` (plus `workersMax` with --apply-max and
`idleTimeout` with --apply-idle-timeout), the REST API's documented endpoint update (see scaling.runpod_api).
RunPod's own scaler still adds workers above the minimum on queue delay; the controller holds workers warm ahead
of demand and lets them go (its minimum falls) once the policy's keep-alive has passed.
The key comes from RUNPOD_API_KEY and is only ever sent in the Authorization header.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable

from scaling.policy import Decision, IdleGaps, Observation, PolicyConfig, decide
from scaling.runpod_api import QUEUE_API, REST_API, EndpointHealth, RunPodApi, RunPodApiError

log = logging.getLogger("scaling.controller")

RUNPOD_IDLE_TIMEOUT_RANGE = (1, 3600)  # seconds RunPod accepts for an endpoint's idleTimeout
GAP_HISTORY = 32  # idle gaps remembered for the keep-alive


class ArrivalMeter:
    """Arrival rate from successive /health counts: new requests = the growth of completed + failed + queued + running
    between two polls, smoothed by an exponentially weighted moving average over `window_s`. Also the lengths of the
    gaps with no request at all, how long the current one has lasted, and how long the oldest queued request has
    waited (first in, first out: the queue's head is request number taken + 1, where taken = seen - in queue; it
    had arrived by the first poll whose count reached that number, so the wait is a lower bound)."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.rate = 0.0
        self.idle = IdleGaps(GAP_HISTORY)
        self._last: tuple[float, int] | None = None
        self._counts: deque[tuple[float, int]] = deque()  # (poll time, requests seen by then), oldest first
        self.oldest_wait_s = 0.0

    def update(self, now: float, health: EndpointHealth) -> int:
        """Take one poll; returns the requests that arrived since the previous one."""
        seen = health.seen
        arrived = 0
        if self._last is not None:
            last_t, last_seen = self._last
            dt = max(now - last_t, 1e-6)
            arrived = max(0, seen - last_seen)  # the counts may be windowed by RunPod: a drop is no arrival
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


def observation(health: EndpointHealth, meter: ArrivalMeter, now: float, *, capacity: float, cold_start_s: float,
                mean_service_s: float) -> Observation:
    """The policy's view of one /health answer: ready workers are the idle and the running ones, booting workers are
    those RunPod reports initializing."""
    return Observation(in_queue=health.in_queue, in_progress=health.in_progress,
                       workers_ready=health.workers_idle + health.workers_running,
                       workers_booting=health.workers_initializing, workers_idle=health.workers_idle,
                       capacity_per_worker=capacity, arrival_rate=meter.rate, mean_service_s=mean_service_s,
                       cold_start_s=cold_start_s, oldest_wait_s=meter.oldest_wait_s, idle_gaps_s=tuple(meter.gaps),
                       idle_for_s=meter.idle_for(now))


def update_body(decision: Decision, config: PolicyConfig, *, apply_max: bool, apply_idle_timeout: bool) -> dict:
    """The EndpointUpdateInput fields that apply a decision."""
    body = {"workersMin": int(decision.desired_workers)}
    if apply_max:
        body["workersMax"] = int(config.max_workers)
    if apply_idle_timeout:
        low, high = RUNPOD_IDLE_TIMEOUT_RANGE
        body["idleTimeout"] = int(min(high, max(low, round(decision.keep_alive_s))))
    return body


class Controller:
    """Poll, decide, apply: one `step()` per interval. Sends an update only when it would change the endpoint
    (`current`: its settings as read at start)."""

    def __init__(self, api: RunPodApi, config: PolicyConfig, *, capacity: float, cold_start_s: float,
                 mean_service_s: float = 10.0, rate_window_s: float = 60.0, dry_run: bool = False,
                 apply_max: bool = False, apply_idle_timeout: bool = False,
                 out: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
                 current: dict | None = None):
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
        """One poll: the decision, the update body, and what was done with it (dry-run / applied / unchanged)."""
        health = self.api.health()
        now = self.clock()
        arrived = self.meter.update(now, health)
        obs = observation(health, self.meter, now, capacity=self.capacity, cold_start_s=self.cold_start_s,
                          mean_service_s=self.mean_service_s)
        decision = decide(obs, self.config)
        body = update_body(decision, self.config, apply_max=self.apply_max,
                           apply_idle_timeout=self.apply_idle_timeout)
        if self.dry_run:
            action = "dry-run"
        elif all(self.current.get(k) == v for k, v in body.items()):
            action = "unchanged"
        else:
            self.api.update_endpoint(**body)
            self.current.update(body)
            action = "applied"
        self.out(f"{time.strftime('%H:%M:%S')} queue={health.in_queue} running={health.in_progress} "
                 f"arrived={arrived} rate={self.meter.rate:.3f}/s workers ready={obs.workers_ready} "
                 f"booting={obs.workers_booting} idle={obs.workers_idle} -> {json.dumps(body, sort_keys=True)} "
                 f"keep_alive={decision.keep_alive_s:.0f}s [{action}] {' '.join(decision.reasons)}")
        return decision, body, action

    def run(self, interval_s: float, iterations: int = 0, max_failures: int = 3) -> int:
        """Step every interval_s until `iterations` steps (0: forever). A refused key or an unknown endpoint stops at
        once; an unreachable API stops after max_failures polls in a row. Returns the exit status."""
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


def recommend(config: PolicyConfig, *, capacity: float, cold_start_s: float, mean_service_s: float,
              arrival_rate: float) -> dict:
    """RunPod's native settings closest to the policy, for endpoints run without a controller.

    - scaler: REQUEST_COUNT targets ceil((inQueue + inProgress) / scalerValue) workers, so scalerValue is the requests
      one worker serves at the planned utilisation (capacity x target_utilization); a worker that serves one request
      at a time gains nothing from that, so it gets QUEUE_DELAY with the latency budget (a worker is added once a
      request has waited that long).
    - workersMin: the policy's workers for a steady `arrival_rate` (requests/s) with an empty queue.
    - idleTimeout: the policy's keep-alive (about one cold start), within RunPod's 1-3600 s.
    """
    per_worker = math.floor(capacity * config.target_utilization)
    if per_worker >= 2:
        scaler = {"scalerType": "REQUEST_COUNT", "scalerValue": int(per_worker)}
    else:
        scaler = {"scalerType": "QUEUE_DELAY", "scalerValue": int(max(1, round(config.latency_budget_s)))}
    in_service = arrival_rate * mean_service_s
    steady = Observation(in_queue=0, in_progress=int(math.ceil(in_service)), workers_ready=0, workers_booting=0,
                         workers_idle=0, capacity_per_worker=capacity, arrival_rate=arrival_rate,
                         mean_service_s=mean_service_s, cold_start_s=cold_start_s)
    decision = decide(steady, config)
    low, high = RUNPOD_IDLE_TIMEOUT_RANGE
    return {**scaler, "workersMin": int(decision.desired_workers) if arrival_rate > 0 else int(config.min_workers),
            "workersMax": int(config.max_workers),
            "idleTimeout": int(min(high, max(low, round(decision.keep_alive_s))))}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m scaling.controller", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--endpoint", help="RunPod endpoint id (needed unless --recommend)")
    ap.add_argument("--dry-run", action="store_true", help="poll and print decisions, change nothing")
    ap.add_argument("--recommend", action="store_true",
                    help="print the native RunPod settings (scaler type and value, idle timeout) and exit")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between polls")
    ap.add_argument("--iterations", type=int, default=0, help="stop after this many polls (0: run until stopped)")
    ap.add_argument("--min-workers", type=int, default=0)
    ap.add_argument("--max-workers", type=int, default=None,
                    help="most workers the policy asks for (default: the endpoint's workersMax, read at start)")
    ap.add_argument("--apply-max", action="store_true", help="also set the endpoint's workersMax to --max-workers")
    ap.add_argument("--apply-idle-timeout", action="store_true",
                    help="also set the endpoint's idleTimeout to the policy's keep-alive")
    ap.add_argument("--latency-budget", type=float, default=2.0, help="queue wait (s) accepted before adding workers")
    ap.add_argument("--cold-start", type=float, default=30.0,
                    help="worker start to ready (s): the cold_start_s the worker reports in its job metrics")
    ap.add_argument("--capacity", type=float, default=8.0,
                    help="concurrent requests one worker sustains: the capacity_requests its job metrics report")
    ap.add_argument("--mean-service", type=float, default=10.0, help="mean seconds one request holds a slot")
    ap.add_argument("--rate", type=float, default=0.0, help="--recommend: steady arrival rate (requests/s)")
    ap.add_argument("--rate-window", type=float, default=60.0, help="seconds the arrival-rate average spans")
    ap.add_argument("--api-base", default=QUEUE_API, help="queue API base (GET {base}/{id}/health)")
    ap.add_argument("--rest-base", default=REST_API, help="REST API base (PATCH {base}/endpoints/{id})")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds one API call may take")
    ap.add_argument("--max-failures", type=int, default=3, help="unreachable polls in a row before giving up")
    return ap


def _check(args: argparse.Namespace) -> None:
    for name in ("interval", "latency_budget", "cold_start", "capacity", "mean_service", "rate_window", "timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(args, name)}")
    if args.rate < 0:
        raise ValueError(f"--rate: must be >= 0, got {args.rate}")
    if args.min_workers < 0:
        raise ValueError(f"--min-workers: must be >= 0, got {args.min_workers}")
    if args.max_workers is not None and args.max_workers < max(1, args.min_workers):
        raise ValueError(f"--max-workers: must be >= max(1, --min-workers), got {args.max_workers}")
    if args.iterations < 0 or args.max_failures < 1:
        raise ValueError("--iterations: must be >= 0; --max-failures: must be >= 1")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _check(args)
        if args.recommend:
            config = PolicyConfig(latency_budget_s=args.latency_budget, min_workers=args.min_workers,
                                  max_workers=args.max_workers or PolicyConfig().max_workers)
            settings = recommend(config, capacity=args.capacity, cold_start_s=args.cold_start,
                                 mean_service_s=args.mean_service, arrival_rate=args.rate)
            print("Recommended RunPod endpoint settings (no controller):")
            for key, value in settings.items():
                print(f"  {key}: {value}")
            print(f"PATCH {args.rest_base.rstrip('/')}/endpoints/{args.endpoint or '<endpoint id>'} "
                  f"{json.dumps(settings)}")
            return 0
        if not args.endpoint:
            raise ValueError("--endpoint: required (the RunPod endpoint id) unless --recommend")
        api = RunPodApi(os.environ.get("RUNPOD_API_KEY", ""), args.endpoint, queue_api=args.api_base,
                        rest_api=args.rest_base, timeout_s=args.timeout)
        current = api.get_endpoint()  # checks the key and the endpoint before the first poll
        max_workers = args.max_workers
        if max_workers is None:
            max_workers = int(current.get("workersMax") or PolicyConfig().max_workers)
        config = PolicyConfig(latency_budget_s=args.latency_budget, min_workers=args.min_workers,
                              max_workers=max(max_workers, args.min_workers, 1))
    except (ValueError, RunPodApiError) as exc:
        log.error("%s", exc)
        return 2 if isinstance(exc, ValueError) else 1
    log.info("controlling endpoint %s%s: capacity %.0f requests/worker, cold start %.0fs, latency budget %.1fs, "
             "%d-%d workers", args.endpoint, " (dry run)" if args.dry_run else "", args.capacity, args.cold_start,
             args.latency_budget, config.min_workers, config.max_workers)
    controller = Controller(api, config, capacity=args.capacity, cold_start_s=args.cold_start,
                            mean_service_s=args.mean_service, rate_window_s=args.rate_window, dry_run=args.dry_run,
                            apply_max=args.apply_max, apply_idle_timeout=args.apply_idle_timeout,
                            out=lambda line: print(line, flush=True), current=current)
    try:
        return controller.run(args.interval, args.iterations, args.max_failures)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
