"""`--recommend`: the native RunPod endpoint settings (scaler type and value, workersMin,
workersMax, idleTimeout) closest to the policy, for endpoints run without a controller.
"""

from __future__ import annotations

import math

from scaling.controller.loop import RUNPOD_IDLE_TIMEOUT_RANGE
from scaling.policy import Observation, PolicyConfig, decide


def recommend(
    config: PolicyConfig,
    *,
    capacity: float,
    cold_start_s: float,
    mean_service_s: float,
    arrival_rate: float,
) -> dict:
    """RunPod's native settings closest to the policy, for endpoints run without a controller.

    - scaler: REQUEST_COUNT targets ceil((inQueue + inProgress) / scalerValue) workers, so
      scalerValue is the requests one worker serves at the planned utilisation (capacity x
      target_utilization); a worker that serves one request at a time gains nothing from that, so it
      gets QUEUE_DELAY with the latency budget (a worker is added once a request has waited that
      long).
    - workersMin: the policy's workers for a steady `arrival_rate` (requests/s) with an empty queue.
    - idleTimeout: the policy's keep-alive (about one cold start), within RunPod's 1-3600 s.
    """
    per_worker = math.floor(capacity * config.target_utilization)
    if per_worker >= 2:
        scaler = {"scalerType": "REQUEST_COUNT", "scalerValue": int(per_worker)}
    else:
        budget = int(max(1, round(config.latency_budget_s)))
        scaler = {"scalerType": "QUEUE_DELAY", "scalerValue": budget}
    in_service = arrival_rate * mean_service_s
    steady = Observation(
        in_queue=0,
        in_progress=int(math.ceil(in_service)),
        workers_ready=0,
        workers_booting=0,
        workers_idle=0,
        capacity_per_worker=capacity,
        arrival_rate=arrival_rate,
        mean_service_s=mean_service_s,
        cold_start_s=cold_start_s,
    )
    decision = decide(steady, config)
    low, high = RUNPOD_IDLE_TIMEOUT_RANGE
    steady_min = decision.desired_workers if arrival_rate > 0 else config.min_workers
    return {
        **scaler,
        "workersMin": int(steady_min),
        "workersMax": int(config.max_workers),
        "idleTimeout": int(min(high, max(low, round(decision.keep_alive_s)))),
    }
