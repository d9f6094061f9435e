"""Serving metrics in the Prometheus text format: request counts, tokens in and out, TTFT, latency
and queue-wait histograms, and what a scaler needs: the worker's capacity (the concurrent requests
its free KV blocks hold) and its cold start.

The OpenAI routes record into one `Metrics`; `render(stats)` adds the engine's gauges (running,
waiting, KV blocks).
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

PREFIX = "coldbrew"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_WAIT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
# the size assumed of a typical request (prompt + output) until some have been served
SEED_REQUEST_TOKENS = 1024
REQUEST_SIZE_WEIGHT = 0.1  # weight of the newest request in the moving average of request sizes


def next_typical_tokens(typical: float, prompt_tokens: int, output_tokens: int) -> float:
    """The moving average of request sizes (prompt + output tokens) after one more finished
    request."""
    return typical + REQUEST_SIZE_WEIGHT * (prompt_tokens + output_tokens - typical)


def sustainable_requests(
    free_blocks: int,
    held: int,
    typical_tokens: float,
    block_size: int,
    context_limit: int,
    limit: int,
) -> int:
    """Concurrent requests a worker sustains now: those it holds plus as many typical requests as
    its free KV blocks hold (a typical request is never planned larger than the context limit),
    within [1, limit]."""
    typical_blocks = max(1, -(-int(min(typical_tokens, context_limit)) // block_size))
    return max(1, min(limit, held + free_blocks // typical_blocks))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip([*map(_num, self.buckets), "+Inf"], self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [f"{name}_sum {_num(self.total)}", f"{name}_count {self.count}"]
        return out


def _num(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Counters and histograms shared by every request of one process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (route, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.in_flight = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.queue_wait = Histogram(QUEUE_WAIT_BUCKETS)
        self.typical_tokens = float(SEED_REQUEST_TOKENS)

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, route: str, status: int) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[(route, status)] += 1

    def record_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self.typical_tokens = next_typical_tokens(
                self.typical_tokens, prompt_tokens, generation_tokens
            )

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_latency(self, seconds: float) -> None:
        with self._lock:
            self.latency.observe(seconds)

    def observe_queue_wait(self, seconds: float) -> None:
        with self._lock:
            self.queue_wait.observe(seconds)

    def capacity(self, stats, engine) -> int:
        """Concurrent requests this server sustains now (see sustainable_requests): the running ones
        (waiting ones hold no blocks yet: they are among those the free blocks hold) plus typical
        requests in the free blocks."""
        core = engine.engine
        return sustainable_requests(
            stats.num_free_blocks,
            stats.num_running,
            self.typical_tokens,
            core.args.block_size,
            core.context_limit,
            core.args.max_num_seqs,
        )

    def render(
        self,
        stats=None,
        ready: bool = True,
        *,
        engine=None,
        cold_start: dict[str, float] | None = None,
        capacity: int | None = None,
    ) -> str:
        """The Prometheus text exposition; `stats` is the engine's EngineStats (or None before it is
        loaded).

        `cold_start`: the boot's timed phases in seconds; `capacity`: the concurrent requests
        sustained now (else computed from `stats` and `engine`, the AsyncLLM, when both are
        given)."""
        p = PREFIX
        if capacity is None and stats is not None and engine is not None:
            capacity = self.capacity(stats, engine)
        lines = [
            f"# HELP {p}_ready 1 once the engine is loaded.",
            f"# TYPE {p}_ready gauge",
            f"{p}_ready {int(ready)}",
        ]
        with self._lock:
            lines += [
                f"# HELP {p}_requests_total Finished OpenAI requests by route and HTTP status.",
                f"# TYPE {p}_requests_total counter",
            ]
            for (route, status), n in sorted(self.requests.items()):
                lines.append(
                    f'{p}_requests_total{{route="{_escape(route)}",status="{status}"}} {n}'
                )
            lines += [
                f"# HELP {p}_requests_in_flight Requests being served now.",
                f"# TYPE {p}_requests_in_flight gauge",
                f"{p}_requests_in_flight {self.in_flight}",
                f"# HELP {p}_prompt_tokens_total Prompt tokens of completed requests.",
                f"# TYPE {p}_prompt_tokens_total counter",
                f"{p}_prompt_tokens_total {self.prompt_tokens}",
                f"# HELP {p}_generation_tokens_total Tokens generated for completed requests.",
                f"# TYPE {p}_generation_tokens_total counter",
                f"{p}_generation_tokens_total {self.generation_tokens}",
                f"# HELP {p}_time_to_first_token_seconds Request arrival to its first token.",
                f"# TYPE {p}_time_to_first_token_seconds histogram",
                *self.ttft.lines(f"{p}_time_to_first_token_seconds"),
                f"# HELP {p}_request_latency_seconds Request arrival to its last token.",
                f"# TYPE {p}_request_latency_seconds histogram",
                *self.latency.lines(f"{p}_request_latency_seconds"),
                f"# HELP {p}_queue_wait_seconds Request arrival to its first engine step "
                "(RunPod jobs: handler start, so the wait for the engine to load counts).",
                f"# TYPE {p}_queue_wait_seconds histogram",
                *self.queue_wait.lines(f"{p}_queue_wait_seconds"),
                f"# HELP {p}_typical_request_tokens "
                "Moving average of prompt + output tokens per request.",
                f"# TYPE {p}_typical_request_tokens gauge",
                f"{p}_typical_request_tokens {_num(round(self.typical_tokens, 3))}",
            ]
        # one copy (in C, atomic): the boot thread may still be adding phases
        cold_start = dict(cold_start or {})
        if cold_start:
            lines += [
                f"# HELP {p}_cold_start_seconds Seconds each start-up phase took (before_boot: "
                "process start to the boot's start; total: the boot's start to ready).",
                f"# TYPE {p}_cold_start_seconds gauge",
            ]
            lines += [
                f'{p}_cold_start_seconds{{phase="{_escape(phase)}"}} {_num(float(seconds))}'
                for phase, seconds in cold_start.items()
            ]
        if capacity is not None:
            lines += [
                f"# HELP {p}_capacity_requests Concurrent requests this worker sustains now: "
                "those it holds plus as many typical requests as its free KV blocks hold.",
                f"# TYPE {p}_capacity_requests gauge",
                f"{p}_capacity_requests {int(capacity)}",
            ]
        if stats is not None:
            gauges = {
                "num_requests_running": ("Sequences in the running batch.", stats.num_running),
                "num_requests_waiting": ("Sequences waiting to be scheduled.", stats.num_waiting),
                "kv_blocks_total": ("KV-cache blocks.", stats.num_kv_blocks),
                "kv_blocks_free": ("KV-cache blocks free.", stats.num_free_blocks),
                "kv_blocks_used": (
                    "KV-cache blocks in use.",
                    stats.num_kv_blocks - stats.num_free_blocks,
                ),
                "kv_blocks_peak_used": (
                    "Most KV-cache blocks ever in use.",
                    stats.peak_used_blocks,
                ),
            }
            for name, (help_text, value) in gauges.items():
                lines += [
                    f"# HELP {p}_{name} {help_text}",
                    f"# TYPE {p}_{name} gauge",
                    f"{p}_{name} {value}",
                ]
            counters = {
                "prefix_cache_queried_tokens_total": (
                    "Prompt tokens looked up in the prefix cache.",
                    stats.prefix_cache_queried_tokens,
                ),
                "prefix_cache_hit_tokens_total": (
                    "Prompt tokens served from the prefix cache.",
                    stats.prefix_cache_hit_tokens,
                ),
                "preemptions_total": (
                    "Sequences preempted for lack of KV blocks.",
                    stats.num_preemptions,
                ),
            }
            for name, (help_text, value) in counters.items():
                lines += [
                    f"# HELP {p}_{name} {help_text}",
                    f"# TYPE {p}_{name} counter",
                    f"{p}_{name} {value}",
                ]
        return "\n".join(lines) + "\n"
