"""A local stand-in for RunPod's job queue: the job-take, job-stop, job-stream and job-done
endpoints the SDK calls.

It answers as the SDK expects the real queue to, from the runpod SDK's own source (1.12):
runpod/serverless/modules/rp_job.py builds the job-take URL from RUNPOD_WEBHOOK_GET_JOB ($ID: the
worker id), switches to job-take-batch with `batch_size` for more than one job, takes 204 as "no
job" (a single job as an object, a batch as a list), and derives the job-stop URL from the job-take
one. rp_http.py posts results to RUNPOD_WEBHOOK_POST_OUTPUT and streamed chunks to
RUNPOD_WEBHOOK_POST_STREAM.

Tests enqueue jobs, ask for a job to be stopped, and read back what the real runpod SDK worker
posted for each job.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

POLL_HOLD_S = 0.3  # how long an empty job-take or job-stop poll is held open before a 204


class JobQueue:
    """The state behind the endpoints; every method is thread-safe."""

    def __init__(self):
        self.cond = threading.Condition()
        self.pending: list[dict] = []
        self.taken: dict[str, float] = {}
        self.stops: list[str] = []
        self.stops_taken: list[str] = []  # the job ids the SDK's job-stop poll took (1.10 on)
        self.streams: dict[str, list] = defaultdict(list)
        self.done: dict[str, list] = defaultdict(list)  # every job-done post, so duplicates show
        self.events: list[tuple[str, str]] = []  # ("stream" | "done", job id) in arrival order
        self.take_batch_sizes: list[int] = []
        self.worker_ids: set[str] = set()
        # the job-takes' User-Agent headers: the SDK's "RunPod-Python-SDK/<version> (...)" (the
        # ping's is not always: 1.7.2's says python-requests)
        self.user_agents: set[str] = set()

    def put(self, job_id: str, job_input) -> None:
        with self.cond:
            self.pending.append({"id": job_id, "input": job_input})
            self.cond.notify_all()

    def stop(self, job_id: str) -> None:
        with self.cond:
            self.stops.append(job_id)
            self.cond.notify_all()

    def take(self, n: int) -> list[dict]:
        deadline = time.monotonic() + POLL_HOLD_S
        with self.cond:
            while not self.pending and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
            jobs, self.pending = self.pending[:n], self.pending[n:]
            for job in jobs:
                self.taken[job["id"]] = time.monotonic()
            return jobs

    def take_stops(self) -> list[str]:
        deadline = time.monotonic() + POLL_HOLD_S
        with self.cond:
            while not self.stops and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
            stops, self.stops = self.stops, []
            self.stops_taken += stops
            return stops

    def record(self, kind: str, job_id: str, body: dict) -> None:
        with self.cond:
            (self.streams if kind == "stream" else self.done)[job_id].append(body)
            self.events.append((kind, job_id))
            self.cond.notify_all()

    def wait_for(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return True


def _handler(queue: JobQueue):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output quiet
            pass

        def _send(self, status: int, body=None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            url = urlsplit(self.path)
            parts = url.path.strip("/").split("/")  # v2/<endpoint>/<verb>/<worker id>
            query = parse_qs(url.query)
            verb = parts[2] if len(parts) > 2 else ""
            if len(parts) > 3:
                queue.worker_ids.add(parts[3])
            if verb.startswith("job-take"):
                queue.user_agents.add(self.headers.get("User-Agent", ""))
            if verb == "job-take":
                jobs = queue.take(1)
                return self._send(200, jobs[0]) if jobs else self._send(204)
            if verb == "job-take-batch":
                n = int(query.get("batch_size", ["1"])[0])
                queue.take_batch_sizes.append(n)
                jobs = queue.take(n)
                return self._send(200, jobs) if jobs else self._send(204)
            if verb == "job-stop":
                stops = queue.take_stops()
                return self._send(200, {"jobsToStop": stops}) if stops else self._send(204)
            if verb == "ping":
                return self._send(200, {})
            return self._send(404, {"error": f"unknown path {url.path}"})

        def do_POST(self):
            url = urlsplit(self.path)
            # v2/<endpoint>/job-done|job-stream/<worker id>/<job id>
            parts = url.path.strip("/").split("/")
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if len(parts) == 5 and parts[2] in ("job-done", "job-stream"):
                queue.record("stream" if parts[2] == "job-stream" else "done", parts[4], body)
                return self._send(200, {})
            return self._send(404, {"error": f"unknown path {url.path}"})

    return Handler


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    # the worker dropping a kept-alive connection is normal
    def handle_error(self, request, client_address):
        pass


class RunPodJobServer:
    """`with RunPodJobServer() as server:` a threaded HTTP server on 127.0.0.1 (a free port);
    `server.env(pod_id)` gives the RUNPOD_* variables that point a worker at it."""

    def __init__(self):
        self.queue = JobQueue()
        self.httpd = _QuietServer(("127.0.0.1", 0), _handler(self.queue))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v2/test-endpoint"

    def env(self, pod_id: str) -> dict[str, str]:
        return {
            "RUNPOD_POD_ID": pod_id,
            "RUNPOD_AI_API_KEY": "test-key",
            "RUNPOD_WEBHOOK_GET_JOB": f"{self.base}/job-take/$ID?token=t",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{self.base}/job-done/$RUNPOD_POD_ID/$ID?token=t",
            "RUNPOD_WEBHOOK_POST_STREAM": f"{self.base}/job-stream/$RUNPOD_POD_ID/$ID?token=t",
            "RUNPOD_WEBHOOK_PING": f"{self.base}/ping/$RUNPOD_POD_ID?token=t",
            "RUNPOD_PING_INTERVAL": "1000",
            # The SDK's start-up fitness checks probe 8.8.8.8 and the GPU; tests run on loopback
            # only.
            "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
            "RUNPOD_SKIP_GPU_CHECK": "true",
        }

    def __enter__(self) -> "RunPodJobServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
