"""A local stand-in of the RunPod API a scaler talks to, on loopback: the queue API's
`GET /v2/{id}/health` and the REST API's `GET/PATCH /v1/endpoints/{id}` (and its `POST .../update`
synonym), with RunPod's shapes and auth.

The test scripts the /health answers and reads back every request the server got (method, path,
headers, body).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# EndpointUpdateInput in RunPod's REST openapi.json (integers unless noted).
UPDATE_FIELDS = {
    "workersMin": int,
    "workersMax": int,
    "idleTimeout": int,
    "scalerValue": int,
    "scalerType": str,
    "name": str,
    "executionTimeoutMs": int,
    "flashboot": bool,
    "gpuCount": int,
    "templateId": str,
    "networkVolumeId": str,
    "vcpuCount": int,
    "gpuTypeIds": list,
    "dataCenterIds": list,
    "allowedCudaVersions": list,
    "cpuFlavorIds": list,
}
SCALER_TYPES = ("QUEUE_DELAY", "REQUEST_COUNT")


def health_body(
    in_queue=0, in_progress=0, completed=0, failed=0, retried=0, idle=0, running=0, **more_workers
) -> dict:
    """A /health answer as RunPod's docs show it."""
    return {
        "jobs": {
            "completed": completed,
            "failed": failed,
            "inProgress": in_progress,
            "inQueue": in_queue,
            "retried": retried,
        },
        "workers": {"idle": idle, "running": running, **more_workers},
    }


class RunPodApiServer:
    """`with RunPodApiServer(api_key, endpoint_id) as api:` serves on 127.0.0.1 (a free port) until
    the block ends."""

    def __init__(self, api_key: str, endpoint_id: str, *, workers_max: int = 3):
        self.api_key = api_key
        self.endpoint_id = endpoint_id
        self.endpoint = {
            "id": endpoint_id,
            "name": "coldbrew-test",
            "workersMin": 0,
            "workersMax": workers_max,
            "idleTimeout": 5,
            "scalerType": "QUEUE_DELAY",
            "scalerValue": 4,
            "templateId": "tmpl",
        }
        self.health_script: list[dict] = [health_body()]
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="runpod-api", daemon=True
        )

    @property
    def base(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def queue_api(self) -> str:
        return self.base + "/v2"

    @property
    def rest_api(self) -> str:
        return self.base + "/v1"

    def updates(self) -> list[dict]:
        with self._lock:
            return [r for r in self.requests if r["method"] in ("PATCH", "POST")]

    def __enter__(self) -> "RunPodApiServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # ---- the API ---------------------------------------------------------------------------------
    def _next_health(self) -> dict:
        with self._lock:
            return (
                self.health_script.pop(0) if len(self.health_script) > 1 else self.health_script[0]
            )

    def _authorized(self, header: str | None, *, bare_allowed: bool) -> bool:
        if header is None:
            return False
        if header == f"Bearer {self.api_key}":
            return True
        return bare_allowed and header == self.api_key  # the queue API also takes the bare key

    def _update(self, body) -> tuple[int, dict]:
        if not isinstance(body, dict) or not body:
            return 400, {
                "error": "request body: expected a JSON object of EndpointUpdateInput fields"
            }
        for key, value in body.items():
            kind = UPDATE_FIELDS.get(key)
            if kind is None:
                return 400, {"error": f"{key}: not a field of EndpointUpdateInput"}
            if not isinstance(value, kind) or (
                kind is int and (isinstance(value, bool) or value < 0)
            ):
                return 400, {"error": f"{key}: expected {kind.__name__}, got {value!r}"}
        if "scalerType" in body and body["scalerType"] not in SCALER_TYPES:
            return 400, {"error": f"scalerType: one of {SCALER_TYPES}"}
        merged = {**self.endpoint, **body}
        if merged["workersMin"] > merged["workersMax"]:
            return 400, {
                "error": f"workersMin ({merged['workersMin']}) "
                f"exceeds workersMax ({merged['workersMax']})"
            }
        self.endpoint = merged
        return 200, dict(merged)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    body = raw.decode("utf-8", "replace")
                with server._lock:
                    server.requests.append(
                        {
                            "method": method,
                            "path": self.path,
                            "headers": dict(self.headers),
                            "body": body,
                        }
                    )
                parts = self.path.split("?")[0].strip("/").split("/")
                auth = self.headers.get("Authorization")
                if (
                    parts[:1] == ["v2"]
                    and len(parts) == 3
                    and parts[2] == "health"
                    and method == "GET"
                ):
                    if not server._authorized(auth, bare_allowed=True):
                        return self._answer(401, {"error": "Unauthorized"})
                    if parts[1] != server.endpoint_id:
                        return self._answer(404, {"error": "endpoint not found"})
                    return self._answer(200, server._next_health())
                if parts[:2] == ["v1", "endpoints"] and len(parts) in (3, 4):
                    if not server._authorized(auth, bare_allowed=False):
                        return self._answer(401, {"error": "Unauthorized"})
                    if parts[2] != server.endpoint_id:
                        return self._answer(404, {"error": "endpoint not found"})
                    if len(parts) == 3 and method == "GET":
                        return self._answer(200, dict(server.endpoint))
                    if (len(parts) == 3 and method == "PATCH") or (
                        parts[3:] == ["update"] and method == "POST"
                    ):
                        return self._answer(*server._update(body))
                return self._answer(404, {"error": f"no route {method} {self.path}"})

            def do_GET(self) -> None:
                self._serve("GET")

            def do_PATCH(self) -> None:
                self._serve("PATCH")

            def do_POST(self) -> None:
                self._serve("POST")

        return Handler
