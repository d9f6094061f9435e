"""`python -m scaling.endpoint`: a local emulator of a RunPod serverless endpoint that scales real
worker processes (`python -m handler` through the runpod SDK) between zero and --max-workers by
scaling.policy.decide().

This module reads the flags, starts the Endpoint, prints how to call it and stops it on SIGINT or
SIGTERM (draining the workers).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from scaling.endpoint.config import EndpointConfig
from scaling.endpoint.server import Endpoint

log = logging.getLogger("scaling.endpoint")


def parse_args(argv: list[str]) -> EndpointConfig:
    """The config from the flags; arguments after `--` go to each worker."""
    worker_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, worker_args = argv[:cut], argv[cut + 1 :]
    d = EndpointConfig()
    ap = argparse.ArgumentParser(
        prog="python -m scaling.endpoint",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to each worker (python -m handler ...). Workers read their "
        "settings (MODEL_NAME, MAX_CONCURRENCY, ...) from this environment.",
    )
    ap.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    ap.add_argument(
        "--port", type=int, default=d.port, help=f"port; 0 picks a free one (default {d.port})"
    )
    ap.add_argument(
        "--endpoint-id",
        default=d.endpoint_id,
        help=f"the id in /v2/<id>/... (default {d.endpoint_id})",
    )
    ap.add_argument(
        "--min-workers",
        type=int,
        default=d.min_workers,
        help=f"workers kept even when idle (default {d.min_workers})",
    )
    ap.add_argument(
        "--max-workers",
        type=int,
        default=d.max_workers,
        help=f"most workers at once (default {d.max_workers})",
    )
    ap.add_argument(
        "--idle-s",
        type=float,
        default=d.idle_s,
        help=f"longest an idle worker is kept warm before it is drained (default {d.idle_s:.0f})",
    )
    ap.add_argument(
        "--latency-budget-s",
        type=float,
        default=d.latency_budget_s,
        help="queue wait accepted before another worker starts (default 2)",
    )
    ap.add_argument(
        "--cold-start-s",
        type=float,
        default=d.cold_start_s,
        help="worker start time assumed until one is measured (default 30)",
    )
    ap.add_argument(
        "--capacity",
        type=float,
        default=None,
        help="jobs one worker holds, assumed until one reports (default: MAX_CONCURRENCY, else 8)",
    )
    ap.add_argument(
        "--rate-window-s",
        type=float,
        default=d.rate_window_s,
        help="window of the arrival rate (default 30)",
    )
    ap.add_argument(
        "--lease-timeout-s",
        type=float,
        default=d.lease_timeout_s,
        help="a worker silent this long is killed and its jobs retried (default 60)",
    )
    ap.add_argument(
        "--log-dir", default=None, help="where worker logs go (default: a temporary directory)"
    )
    args = ap.parse_args(argv)
    try:
        return EndpointConfig(**vars(args), worker_args=worker_args)
    except ValueError as exc:
        flag = str(exc).split(":")[0].replace("_", "-")
        ap.error(f"--{flag}:{str(exc).split(':', 1)[1]}")


def main(argv: list[str] | None = None) -> None:
    config = parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        endpoint = Endpoint(config).start()
    except OSError as exc:
        sys.exit(
            f"coldbrew: can't listen on {config.host}:{config.port} (--host/--port): "
            f"{exc.strerror or exc}"
        )
    print(
        f"coldbrew local endpoint: {endpoint.base}  (OpenAI: {endpoint.base}/openai/v1)\n"
        f"  curl -s -X POST {endpoint.base}/runsync -H 'Content-Type: application/json' "
        '-d \'{"input": {"prompt": "The capital of France is", '
        '"sampling_params": {"max_tokens": 16}}}\'',
        flush=True,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        pass
    log.info("stopping: draining workers")
    endpoint.stop()
