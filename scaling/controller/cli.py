"""`python -m scaling.controller --endpoint ID`: drives a RunPod endpoint's minimum workers from its
queue with the cold-start-aware policy (scaling.policy); `--dry-run` prints decisions only;
`--recommend` prints native settings.

Each poll reads `GET https://api.runpod.ai/v2/{id}/health` and, when the decision changes, sends
`PATCH https://rest.runpod.io/v1/endpoints/{id}` with `{"workersMin": N}` (plus `workersMax` with
--apply-max and `idleTimeout` with --apply-idle-timeout), the REST API's documented endpoint update
(see scaling.runpod_api). RunPod's own scaler still adds workers above the minimum on queue delay;
the controller holds workers warm ahead of demand and lets them go (its minimum falls) once the
policy's keep-alive has passed. The key comes from RUNPOD_API_KEY and is only ever sent in the
Authorization header.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from scaling.controller.loop import Controller
from scaling.controller.recommend import recommend
from scaling.policy import PolicyConfig
from scaling.runpod_api import QUEUE_API, REST_API, RunPodApi, RunPodApiError

log = logging.getLogger("scaling.controller")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m scaling.controller",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--endpoint", help="RunPod endpoint id (needed unless --recommend)")
    ap.add_argument(
        "--dry-run", action="store_true", help="poll and print decisions, change nothing"
    )
    ap.add_argument(
        "--recommend",
        action="store_true",
        help="print the native RunPod settings (scaler type and value, idle timeout) and exit",
    )
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between polls")
    ap.add_argument(
        "--iterations",
        type=int,
        default=0,
        help="stop after this many polls (0: run until stopped)",
    )
    ap.add_argument("--min-workers", type=int, default=0)
    ap.add_argument(
        "--max-workers",
        type=int,
        default=None,
        help="most workers the policy asks for (default: the endpoint's workersMax, read at start)",
    )
    ap.add_argument(
        "--apply-max",
        action="store_true",
        help="also set the endpoint's workersMax to --max-workers",
    )
    ap.add_argument(
        "--apply-idle-timeout",
        action="store_true",
        help="also set the endpoint's idleTimeout to the policy's keep-alive",
    )
    ap.add_argument(
        "--latency-budget",
        type=float,
        default=2.0,
        help="queue wait (s) accepted before adding workers",
    )
    ap.add_argument(
        "--cold-start",
        type=float,
        default=30.0,
        help="worker start to ready (s): the cold_start_s the worker reports in its job metrics",
    )
    ap.add_argument(
        "--capacity",
        type=float,
        default=8.0,
        help="concurrent requests one worker sustains: the capacity_requests its job "
        "metrics report",
    )
    ap.add_argument(
        "--mean-service", type=float, default=10.0, help="mean seconds one request holds a slot"
    )
    ap.add_argument(
        "--rate", type=float, default=0.0, help="--recommend: steady arrival rate (requests/s)"
    )
    ap.add_argument(
        "--rate-window", type=float, default=60.0, help="seconds the arrival-rate average spans"
    )
    ap.add_argument("--api-base", default=QUEUE_API, help="queue API base (GET {base}/{id}/health)")
    ap.add_argument(
        "--rest-base", default=REST_API, help="REST API base (PATCH {base}/endpoints/{id})"
    )
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds one API call may take")
    ap.add_argument(
        "--max-failures", type=int, default=3, help="unreachable polls in a row before giving up"
    )
    return ap


def _check(args: argparse.Namespace) -> None:
    for name in (
        "interval",
        "latency_budget",
        "cold_start",
        "capacity",
        "mean_service",
        "rate_window",
        "timeout",
    ):
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
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        _check(args)
        if args.recommend:
            config = PolicyConfig(
                latency_budget_s=args.latency_budget,
                min_workers=args.min_workers,
                max_workers=args.max_workers or PolicyConfig().max_workers,
            )
            settings = recommend(
                config,
                capacity=args.capacity,
                cold_start_s=args.cold_start,
                mean_service_s=args.mean_service,
                arrival_rate=args.rate,
            )
            print("Recommended RunPod endpoint settings (no controller):")
            for key, value in settings.items():
                print(f"  {key}: {value}")
            endpoint = args.endpoint or "<endpoint id>"
            print(f"PATCH {args.rest_base.rstrip('/')}/endpoints/{endpoint} {json.dumps(settings)}")
            return 0
        if not args.endpoint:
            raise ValueError("--endpoint: required (the RunPod endpoint id) unless --recommend")
        api = RunPodApi(
            os.environ.get("RUNPOD_API_KEY", ""),
            args.endpoint,
            queue_api=args.api_base,
            rest_api=args.rest_base,
            timeout_s=args.timeout,
        )
        current = api.get_endpoint()  # checks the key and the endpoint before the first poll
        max_workers = args.max_workers
        if max_workers is None:
            max_workers = int(current.get("workersMax") or PolicyConfig().max_workers)
        config = PolicyConfig(
            latency_budget_s=args.latency_budget,
            min_workers=args.min_workers,
            max_workers=max(max_workers, args.min_workers, 1),
        )
    except (ValueError, RunPodApiError) as exc:
        log.error("%s", exc)
        return 2 if isinstance(exc, ValueError) else 1
    log.info(
        "controlling endpoint %s%s: capacity %.0f requests/worker, cold start %.0fs, "
        "latency budget %.1fs, %d-%d workers",
        args.endpoint,
        " (dry run)" if args.dry_run else "",
        args.capacity,
        args.cold_start,
        args.latency_budget,
        config.min_workers,
        config.max_workers,
    )
    controller = Controller(
        api,
        config,
        capacity=args.capacity,
        cold_start_s=args.cold_start,
        mean_service_s=args.mean_service,
        rate_window_s=args.rate_window,
        dry_run=args.dry_run,
        apply_max=args.apply_max,
        apply_idle_timeout=args.apply_idle_timeout,
        out=lambda line: print(line, flush=True),
        current=current,
    )
    try:
        return controller.run(args.interval, args.iterations, args.max_failures)
    except KeyboardInterrupt:
        return 0
