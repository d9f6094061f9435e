"""The local endpoint's scaler: observes the queue and the workers, asks scaling.policy.decide() for
the worker count, starts workers and drains idle ones (down to zero), and polices them: exits,
silence past the lease, stuck boots.

It runs in the endpoint's event loop, one `step` per tick or as soon as a job arrives.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from scaling.endpoint.config import EndpointConfig
from scaling.endpoint.jobs import Job, JobQueue
from scaling.endpoint.workers import Worker, WorkerPool
from scaling.policy import Decision, IdleGaps, Observation, PolicyConfig, decide

log = logging.getLogger("scaling.endpoint")

PROBE_INPUT = {"openai_route": "/v1/models"}  # a job every worker answers once its engine is loaded
DEFAULT_SERVICE_S = 10.0  # mean time a job holds a slot, until some have completed


def reported(output: Any, name: str) -> Any:
    """A value of the `metrics` block the worker puts in a job's final output chunk (None when
    absent)."""
    chunks = output if isinstance(output, list) else [output]
    for chunk in reversed(chunks):
        metrics = chunk.get("metrics") if isinstance(chunk, dict) else None
        if isinstance(metrics, dict) and name in metrics:
            return metrics[name]
    return None


class Scaler:
    def __init__(self, config: EndpointConfig, queue: JobQueue, pool: WorkerPool):
        self.config, self.queue, self.pool = config, queue, pool
        self.policy = PolicyConfig(
            latency_budget_s=config.latency_budget_s,
            min_workers=config.min_workers,
            max_workers=config.max_workers,
            max_keep_alive_s=config.idle_s,
        )
        self.decision: Decision | None = None
        self.cold_start_s: float | None = None  # average start: spawn -> readiness probe done
        self.capacity_seen: float | None = None  # mean capacity the ready workers report
        self.idle = IdleGaps()  # spells with no job queued or running
        self.boot_failures = 0
        self.spawn_after = 0.0  # back-off after failed starts
        self.stopping = False

    # ---- what workers report --------------------------------------------------------------------
    def job_finished(self, job: Job, now: float) -> None:
        """A worker posted a result: note the capacity it reports; its readiness probe makes it
        ready."""
        worker = self.pool.workers.get(job.worker_id or "")
        capacity = reported(job.output, "capacity_requests")
        if worker is not None and isinstance(capacity, int) and capacity > 0:
            worker.reported_capacity = capacity
        if job.probe_for is None or worker is None or worker.state != "booting":
            return
        if job.status == "COMPLETED":
            worker.state, worker.ready_at, worker.idle_since = "ready", now, now
            took = worker.cold_start_s
            average = self.cold_start_s
            self.cold_start_s = took if average is None else 0.5 * average + 0.5 * took
            self.boot_failures = 0
            log.info("%s ready: cold start %.1f s", worker.id, took)
        else:
            self._boot_failed(worker, now, f"its readiness probe failed: {job.error}")

    def health(self) -> dict:
        """RunPod's /health: job counts and worker counts (ready = idle + running), plus the
        scaler's view."""
        q, ready = self.queue, self.pool.live("ready")
        running = sum(1 for w in ready if q.held_by(w.id) > 0)
        d = self.decision
        return {
            "jobs": {
                "completed": q.counts["completed"],
                "failed": q.counts["failed"],
                "inProgress": q.in_progress(),
                "inQueue": q.in_queue(),
                "retried": q.counts["retried"],
            },
            "workers": {
                "idle": len(ready) - running,
                "initializing": len(self.pool.live("booting")),
                "ready": len(ready),
                "running": running,
                "throttled": 0,
                "unhealthy": 0,
                "draining": len(self.pool.live("draining")),
            },
            "scaling": {
                "desiredWorkers": d.desired_workers if d else 0,
                "keepAliveS": round(d.keep_alive_s, 2) if d else None,
                "coldStartS": None if self.cold_start_s is None else round(self.cold_start_s, 2),
                "capacityPerWorker": self.capacity_seen,
                "workersStarted": self.pool.started_total,
            },
        }

    # ---- one pass -------------------------------------------------------------------------------
    def observe(self, now: float) -> Observation:
        q, pool, c = self.queue, self.pool, self.config
        ready = pool.live("ready")
        capacities = [w.capacity for w in ready if w.capacity]
        if capacities:
            self.capacity_seen = sum(capacities) / len(capacities)
        self.idle.observe(now, active=q.in_queue() + q.in_progress() > 0)
        return Observation(
            in_queue=q.in_queue(),
            in_progress=q.in_progress(),
            workers_ready=len(ready),
            workers_booting=len(pool.live("booting")),
            workers_idle=sum(1 for w in ready if q.held_by(w.id) == 0),
            capacity_per_worker=self.capacity_seen or self._prior_capacity(),
            arrival_rate=q.arrival_rate(now, c.rate_window_s),
            mean_service_s=q.service_s if q.service_s is not None else DEFAULT_SERVICE_S,
            cold_start_s=self.cold_start_s or c.cold_start_s,
            oldest_wait_s=q.oldest_wait_s(now),
            idle_gaps_s=tuple(self.idle.gaps),
            idle_for_s=self.idle.idle_for(now),
        )

    def step(self, now: float) -> None:
        """Reap and police the workers, observe, decide, then start workers or drain idle ones."""
        self._police(now)
        for worker in self.pool.live("ready"):
            if self.queue.held_by(worker.id) > 0:
                worker.idle_since = None
            elif worker.idle_since is None:
                worker.idle_since = now
        obs = self.observe(now)
        decision = self.decision = decide(obs, self.policy)
        self.queue.forget_finished(now, self.config.result_keep_s)
        if self.stopping:
            return
        active = obs.workers_ready + obs.workers_booting
        desired = min(decision.desired_workers, self.config.max_workers)
        if desired > active and now >= self.spawn_after:
            log.info(
                "scale up: %d -> %d workers (in queue %d, in progress %d; %s)",
                active,
                desired,
                obs.in_queue,
                obs.in_progress,
                ", ".join(decision.reasons),
            )
            for _ in range(desired - active):
                self._start_worker(now)
        elif desired < active:
            idle = sorted(
                (
                    w
                    for w in self.pool.live("ready")
                    if w.idle_since is not None and now - w.idle_since >= decision.keep_alive_s
                ),
                key=lambda w: w.idle_since,
            )
            for worker in idle[: active - desired]:
                log.info(
                    "scale down: draining %s, idle %.1f s (keep-alive %.1f s; %d -> %d workers)",
                    worker.id,
                    now - worker.idle_since,
                    decision.keep_alive_s,
                    active,
                    active - 1,
                )
                self.pool.drain(worker, now)
                active -= 1

    def drain_all(self, now: float) -> None:
        self.stopping = True
        for worker in self.pool.live("booting", "ready"):
            self.pool.drain(worker, now)

    # ---- internals ------------------------------------------------------------------------------
    def _prior_capacity(self) -> float:
        if self.config.capacity is not None:
            return self.config.capacity
        raw = (
            self.config.worker_env.get("MAX_CONCURRENCY") or os.environ.get("MAX_CONCURRENCY") or ""
        )
        return float(raw) if raw.isdigit() and int(raw) > 0 else 8.0

    def _start_worker(self, now: float) -> Worker:
        worker = self.pool.start(now)
        self.queue.add_probe(worker.id, PROBE_INPUT)
        log.info("%s starting (pid %d, log %s)", worker.id, worker.proc.pid, worker.log_path)
        return worker

    def _police(self, now: float) -> None:
        """Reap exited workers (their jobs retried once or failed); kill silent, stuck or
        slow-draining ones."""
        c = self.config
        for worker in list(self.pool.workers.values()):
            state = worker.state
            code = self.pool.reap(worker)
            if code is not None:
                for job, outcome in self.queue.lose_worker(worker.id, f"exited with status {code}"):
                    if job.probe_for is None:
                        log.warning(
                            "%s exited (status %d) holding job %s: %s",
                            worker.id,
                            code,
                            job.id,
                            outcome,
                        )
                if state == "booting":
                    self._boot_failed(worker, now, f"it exited with status {code} while starting")
                elif state != "draining":
                    log.warning("%s exited unexpectedly with status %d", worker.id, code)
                else:
                    log.info("%s stopped (status %d)", worker.id, code)
                continue
            # None: its SDK has not spoken yet
            silent = None if worker.last_seen is None else now - worker.last_seen
            if silent is not None and silent > c.lease_timeout_s:
                log.warning(
                    "%s silent for %.0f s (lease timeout %.0f s): killing it",
                    worker.id,
                    silent,
                    c.lease_timeout_s,
                )
                self.pool.kill(worker)
            elif state == "booting" and now - worker.started > c.boot_timeout_s:
                log.warning(
                    "%s not ready after %.0f s: killing it", worker.id, now - worker.started
                )
                self.pool.kill(worker)
            elif state == "draining" and now - worker.drain_started > c.drain_timeout_s:
                log.warning(
                    "%s still draining after %.0f s: killing it",
                    worker.id,
                    now - worker.drain_started,
                )
                self.pool.kill(worker)

    def _boot_failed(self, worker: Worker, now: float, why: str) -> None:
        self.boot_failures += 1
        self.spawn_after = now + min(60.0, 2.0**self.boot_failures)
        log.error(
            "%s failed to start: %s; its log ends:\n%s", worker.id, why, self.pool.log_tail(worker)
        )
        if worker.state != "exited":
            self.pool.drain(worker, now)
        if self.boot_failures >= self.config.max_boot_failures:
            failed = self.queue.fail_waiting(
                f"workers fail to start ({self.boot_failures} in a row): {why}"
            )
            if failed:
                log.error("failed %d queued job(s): workers fail to start", failed)
