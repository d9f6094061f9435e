"""Serving metrics in the Prometheus text format: request counts, tokens in and out, TTFT and latency histograms.

The OpenAI routes record into one `Metrics`; `render(stats)` adds the engine's gauges (running, waiting, KV blocks).
"""
from __future__ import annotations

import bisect
import threading
from collections import defaultdict

PREFIX = "coldbrew"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


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

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_latency(self, seconds: float) -> None:
        with self._lock:
            self.latency.observe(seconds)

    def render(self, stats=None, ready: bool = True) -> str:
        """The Prometheus text exposition; `stats` is the engine's EngineStats (or None before it is loaded)."""
        p = PREFIX
        lines = [f"# HELP {p}_ready 1 once the engine is loaded.", f"# TYPE {p}_ready gauge", f"{p}_ready {int(ready)}"]
        with self._lock:
            lines += [f"# HELP {p}_requests_total Finished OpenAI requests by route and HTTP status.",
                      f"# TYPE {p}_requests_total counter"]
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f'{p}_requests_total{{route="{_escape(route)}",status="{status}"}} {n}')
            lines += [f"# HELP {p}_requests_in_flight Requests being served now.",
                      f"# TYPE {p}_requests_in_flight gauge", f"{p}_requests_in_flight {self.in_flight}",
                      f"# HELP {p}_prompt_tokens_total Prompt tokens of completed requests.",
                      f"# TYPE {p}_prompt_tokens_total counter", f"{p}_prompt_tokens_total {self.prompt_tokens}",
                      f"# HELP {p}_generation_tokens_total Tokens generated for completed requests.",
                      f"# TYPE {p}_generation_tokens_total counter",
                      f"{p}_generation_tokens_total {self.generation_tokens}",
                      f"# HELP {p}_time_to_first_token_seconds Request arrival to its first token.",
                      f"# TYPE {p}_time_to_first_token_seconds histogram",
                      *self.ttft.lines(f"{p}_time_to_first_token_seconds"),
                      f"# HELP {p}_request_latency_seconds Request arrival to its last token.",
                      f"# TYPE {p}_request_latency_seconds histogram",
                      *self.latency.lines(f"{p}_request_latency_seconds")]
        if stats is not None:
            gauges = {
                "num_requests_running": ("Sequences in the running batch.", stats.num_running),
                "num_requests_waiting": ("Sequences waiting to be scheduled.", stats.num_waiting),
                "kv_blocks_total": ("KV-cache blocks.", stats.num_kv_blocks),
                "kv_blocks_free": ("KV-cache blocks free.", stats.num_free_blocks),
                "kv_blocks_used": ("KV-cache blocks in use.", stats.num_kv_blocks - stats.num_free_blocks),
                "kv_blocks_peak_used": ("Most KV-cache blocks ever in use.", stats.peak_used_blocks),
            }
            for name, (help_text, value) in gauges.items():
                lines += [f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} gauge", f"{p}_{name} {value}"]
            counters = {
                "prefix_cache_queried_tokens_total": ("Prompt tokens looked up in the prefix cache.",
                                                      stats.prefix_cache_queried_tokens),
                "prefix_cache_hit_tokens_total": ("Prompt tokens served from the prefix cache.",
                                                  stats.prefix_cache_hit_tokens),
                "preemptions_total": ("Sequences preempted for lack of KV blocks.", stats.num_preemptions),
            }
            for name, (help_text, value) in counters.items():
                lines += [f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} counter", f"{p}_{name} {value}"]
        return "\n".join(lines) + "\n"
