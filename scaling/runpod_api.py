"""A small client of the two RunPod calls a scaler needs: an endpoint's queue and workers, and
setting its workers.

- `GET https://api.runpod.ai/v2/{endpoint_id}/health` (RunPod docs, "Operation reference", /health)
  answers `{"jobs": {"completed", "failed", "inProgress", "inQueue", "retried"}, "workers": {"idle",
  "running", ...}}`; some endpoints also report workers "initializing", "ready", "throttled" or
  "unhealthy".
- `PATCH https://rest.runpod.io/v1/endpoints/{endpoint_id}` (RunPod REST API v1, operation "Update
  an endpoint", openapi.json `EndpointUpdateInput`) takes any of `workersMin`, `workersMax`,
  `idleTimeout`, `scalerType`, `scalerValue` ... and answers the endpoint; `GET` on the same path
  reads it.

Both authenticate with `Authorization: Bearer <RUNPOD_API_KEY>`. The key is sent in that header
only: never in a URL, a log line or an error message.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass

QUEUE_API = "https://api.runpod.ai/v2"
REST_API = "https://rest.runpod.io/v1"


class RunPodApiError(RuntimeError):
    """A RunPod API call failed; the message says which call, where, and why (never the key)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class EndpointHealth:
    """One /health answer, as counts."""

    in_queue: int
    in_progress: int
    completed: int
    failed: int
    retried: int
    workers_idle: int
    workers_running: int
    workers_initializing: int
    workers_throttled: int
    workers_unhealthy: int

    @classmethod
    def from_json(cls, body: dict) -> "EndpointHealth":
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("jobs"), dict)
            or not isinstance(body.get("workers"), dict)
        ):
            raise RunPodApiError(f"/health answered an unexpected shape: {str(body)[:200]}")
        jobs, workers = body["jobs"], body["workers"]

        def count(group: dict, key: str) -> int:
            value = group.get(key, 0)
            return int(value) if isinstance(value, (int, float)) and value >= 0 else 0

        return cls(
            in_queue=count(jobs, "inQueue"),
            in_progress=count(jobs, "inProgress"),
            completed=count(jobs, "completed"),
            failed=count(jobs, "failed"),
            retried=count(jobs, "retried"),
            workers_idle=count(workers, "idle"),
            workers_running=count(workers, "running"),
            workers_initializing=count(workers, "initializing"),
            workers_throttled=count(workers, "throttled"),
            workers_unhealthy=count(workers, "unhealthy"),
        )

    @property
    def seen(self) -> int:
        """Every request the endpoint has taken that these counts show: finished or still queued or
        running."""
        return self.completed + self.failed + self.in_queue + self.in_progress


class RunPodApi:
    """The /health read and the endpoint update, against the real API or a stand-in (base URLs)."""

    def __init__(
        self,
        api_key: str,
        endpoint_id: str,
        *,
        queue_api: str = QUEUE_API,
        rest_api: str = REST_API,
        timeout_s: float = 10.0,
    ):
        if not api_key:
            raise RunPodApiError(
                "RUNPOD_API_KEY is not set; create a key at "
                "https://www.runpod.io/console/user/settings and export it"
            )
        if not endpoint_id or "/" in endpoint_id:
            raise RunPodApiError(f"--endpoint: {endpoint_id!r} is not an endpoint id")
        self._key = api_key
        self.endpoint_id = endpoint_id
        self.queue_api = queue_api.rstrip("/")
        self.rest_api = rest_api.rstrip("/")
        self.timeout_s = timeout_s

    def __repr__(self) -> str:  # never the key
        return (
            f"RunPodApi(endpoint_id={self.endpoint_id!r}, queue_api={self.queue_api!r}, "
            f"rest_api={self.rest_api!r})"
        )

    def health(self) -> EndpointHealth:
        url = f"{self.queue_api}/{self.endpoint_id}/health"
        return EndpointHealth.from_json(self._call("GET", url))

    def get_endpoint(self) -> dict:
        """The endpoint's settings (workersMin, workersMax, idleTimeout, scalerType, ...)."""
        return self._call("GET", f"{self.rest_api}/endpoints/{self.endpoint_id}")

    def update_endpoint(self, **fields) -> dict:
        """PATCH the endpoint with EndpointUpdateInput fields (workersMin=..., workersMax=...)."""
        return self._call("PATCH", f"{self.rest_api}/endpoints/{self.endpoint_id}", fields)

    def _call(self, method: str, url: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            url,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self._key}",
                "Accept": "application/json",
                **({"Content-Type": "application/json"} if data is not None else {}),
            },
        )
        what = f"{method} {url}"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = _scrub(exc.read(300).decode("utf-8", "replace"), self._key)
            if exc.code in (401, 403):
                raise RunPodApiError(
                    f"{what}: HTTP {exc.code}: RUNPOD_API_KEY was refused (check "
                    "that it is valid and has access to this endpoint)",
                    exc.code,
                ) from None
            if exc.code == 404:
                raise RunPodApiError(
                    f"{what}: HTTP 404: no endpoint {self.endpoint_id!r} here", 404
                ) from None
            raise RunPodApiError(
                f"{what}: HTTP {exc.code}: {detail.strip()[:200]}", exc.code
            ) from None
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RunPodApiError(
                f"{what}: cannot reach the RunPod API: {_scrub(str(reason), self._key)}"
            ) from None
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            text = _scrub(raw[:200].decode("utf-8", "replace"), self._key)
            raise RunPodApiError(f"{what}: the answer is not JSON: {text}") from None


def _scrub(text: str, key: str) -> str:
    return text.replace(key, "***") if key else text
