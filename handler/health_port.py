"""A second port for the health check of RunPod load balancing (PORT_HEALTH): GET /ping there
answers what the server's own /ping answers (204 loading, 200 ready, 503 failed); 204 until the
server listens, 503 once it has stopped.

The load balancer polls /ping on PORT_HEALTH and reads 200 as healthy, 204 as initializing and
anything else as unhealthy (runpod/docs serverless/load-balancing/overview.mdx).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HEALTH_PATH = "/ping"
# How long one health check waits for the server's own /ping before calling it unhealthy.
ASK_TIMEOUT_S = 10.0


def _loopback_for(host: str) -> str:
    """Where this process reaches a server bound to `host`."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _json(obj: dict) -> bytes:
    return json.dumps(obj).encode()


class HealthPort(ThreadingHTTPServer):
    """Answers GET /ping on its own port by asking the main server's /ping on loopback."""

    daemon_threads = True

    def __init__(self, host: str, port: int, server_host: str, server_port: int):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)
        self.server_to_ask = (_loopback_for(server_host), server_port)
        # Set once the main server has answered: a refused connection then means it stopped.
        self.server_answered = threading.Event()

    def ask_server(self) -> tuple[int, bytes]:
        """(status, body) of the main server's /ping."""
        conn = http.client.HTTPConnection(*self.server_to_ask, timeout=ASK_TIMEOUT_S)
        try:
            conn.request("GET", HEALTH_PATH)
            reply = conn.getresponse()
            body = reply.read()
        except OSError as exc:
            if isinstance(exc, ConnectionRefusedError) and not self.server_answered.is_set():
                return 204, b""  # still starting: the server does not listen yet
            return 503, _json({"status": "failed", "error": f"server: {type(exc).__name__}"})
        finally:
            conn.close()
        self.server_answered.set()
        return reply.status, body

    def start(self) -> "HealthPort":
        threading.Thread(
            target=self.serve_forever, name="coldbrew-health-port", daemon=True
        ).start()
        return self


class _Handler(BaseHTTPRequestHandler):
    server: HealthPort

    def log_message(self, *args) -> None:  # the load balancer polls often: no access log
        pass

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == HEALTH_PATH:
            status, body = self.server.ask_server()
        else:
            status = 404
            message = (
                f"route {self.path[:200]!r} does not exist on the health port; "
                f"the load balancer's health check is {HEALTH_PATH}"
            )
            body = _json(
                {
                    "error": {
                        "message": message,
                        "type": "not_found_error",
                        "param": None,
                        "code": 404,
                    }
                }
            )
        self.send_response(status)
        if status != 204:
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if status != 204:
            self.wfile.write(body)
