"""The local endpoint's settings (its CLI flags), checked at construction: a bad value raises
ValueError naming the field and its allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EndpointConfig:
    """Times in seconds."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    endpoint_id: str = "local"
    min_workers: int = 0
    max_workers: int = 4
    idle_s: float = 60.0  # longest an idle worker is kept warm (the policy's keep-alive, at most)
    latency_budget_s: float = 2.0
    cold_start_s: float = 30.0  # assumed until a worker has started and been measured
    # jobs a worker holds, assumed until one reports (None: MAX_CONCURRENCY or 8)
    capacity: float | None = None
    rate_window_s: float = 30.0  # arrivals over this window give the arrival rate
    # a worker silent this long (no poll, no heartbeat) is killed and its jobs retried
    lease_timeout_s: float = 60.0
    boot_timeout_s: float = 900.0
    drain_timeout_s: float = 60.0
    # failed starts in a row after which the queued jobs fail with the start error
    max_boot_failures: int = 3
    # finished jobs stay readable this long (RunPod keeps /run results 30 minutes)
    result_keep_s: float = 1800.0
    tick_s: float = 0.25
    log_dir: str | None = None  # worker logs (None: a temporary directory)
    # added to this process's environment for workers
    worker_env: dict[str, str] = field(default_factory=dict)
    worker_command: list[str] | None = None  # default: python -m handler
    worker_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        checks = (
            ("port", 0 <= self.port <= 65535, "in [0, 65535]"),
            ("min_workers", 0 <= self.min_workers <= 256, "in [0, 256]"),
            (
                "max_workers",
                max(1, self.min_workers) <= self.max_workers <= 256,
                "in [max(1, min_workers), 256]",
            ),
            ("idle_s", 0 <= self.idle_s <= 86400, "in [0, 86400]"),
            ("latency_budget_s", 0 <= self.latency_budget_s <= 3600, "in [0, 3600]"),
            ("cold_start_s", 0 < self.cold_start_s <= 3600, "in (0, 3600]"),
            ("capacity", self.capacity is None or 0 < self.capacity <= 100_000, "in (0, 100000]"),
            ("rate_window_s", 0 < self.rate_window_s <= 3600, "in (0, 3600]"),
            ("lease_timeout_s", 5 <= self.lease_timeout_s <= 86400, "in [5, 86400]"),
            ("boot_timeout_s", 1 <= self.boot_timeout_s <= 86400, "in [1, 86400]"),
            ("drain_timeout_s", 1 <= self.drain_timeout_s <= 86400, "in [1, 86400]"),
            ("max_boot_failures", 1 <= self.max_boot_failures <= 1000, "in [1, 1000]"),
            ("result_keep_s", 1 <= self.result_keep_s <= 86400, "in [1, 86400]"),
            ("tick_s", 0.01 <= self.tick_s <= 10, "in [0.01, 10]"),
            (
                "endpoint_id",
                self.endpoint_id.replace("-", "").replace("_", "").isalnum(),
                "made of letters, digits, - and _",
            ),
        )
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"{name}: must be {limit}, got {getattr(self, name)!r}")
