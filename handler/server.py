"""`python -m handler serve`: the OpenAI routes as a plain HTTP server (Starlette + uvicorn), with
SSE streaming, /health (503 until the engine is ready), /metrics (Prometheus text) and hard limits
on what a request may send. How slowly it may send (handler.http_connection), and the drain on
SIGTERM, which ends what is left with an error event, are set up here too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from handler.config import Settings, SettingsError, load_settings
from handler.engine_boot import EngineBoot, begin
from handler.engine_requests import check_depth
from handler.job_timing import TimedEngine
from handler.limits import MAX_JSON_DEPTH, MAX_REQUEST_LINE_BYTES
from handler.metrics import Metrics
from handler.request_streams import Interrupted
from handler.routes import ROUTE_METHODS, ROUTES, SSE_DONE, ApiError, ChunkStream, OpenAIRoutes, sse

log = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The longest the shutdown waits for the start's background work (kernel warm-up, fleet share) to
# see the engine stopped and end.
BACKGROUND_JOIN_S = 10.0
# How often the server checks that the engine thread is still alive (a dead engine exits the
# process) and whether uvicorn was told to shut down (SIGTERM, SIGINT).
WATCH_SECONDS = 0.2


class ClientLeft(Exception):
    """The client closed its connection before its request body was in."""


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: Request, limit: int):
    """The request body as JSON, refusing (413) a body over `limit` bytes before reading all of it
    and (400) one nested deeper than MAX_JSON_DEPTH. Raises ClientLeft when the connection closes
    first."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413,
            f"body: {int(declared)} bytes exceeds the limit of {limit} bytes (MAX_REQUEST_BYTES)",
            "body",
        )
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise ApiError(
                    413, f"body: more than the limit of {limit} bytes (MAX_REQUEST_BYTES)", "body"
                )
    except ClientDisconnect:
        raise ClientLeft() from None
    if not buf:
        raise ApiError(400, "body: empty; send a JSON object", "body")
    try:
        text = buf.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"body: invalid UTF-8 at byte {e.start}", "body") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ApiError(
            400, f"body: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}", "body"
        ) from None
    except ValueError as e:
        raise ApiError(400, f"body: invalid JSON: {e}", "body") from None
    except RecursionError:  # deeper than the parser's own guard: far deeper than the limit
        raise ApiError(
            400,
            f"body: objects and lists nested deeper than the limit of {MAX_JSON_DEPTH} levels",
            "body",
        ) from None
    check_depth(body)
    return body


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status)


def _shutdown_error(grace_s: float) -> ApiError:
    return ApiError(
        503,
        "the server is shutting down (SIGTERM) and the request did not finish "
        f"within {grace_s:g} s (SHUTDOWN_GRACE_S); retry it",
        type="service_unavailable",
    )


async def _sse_body(stream: ChunkStream, grace_s: float, on_end=None) -> AsyncIterator[str]:
    """Chunks as server-sent events, then [DONE]. An error mid-stream, or the drain deadline (the
    stream is interrupted), is sent as one `{"error": ...}` event before the [DONE]. on_end(stream)
    is called once it is closed."""
    try:
        async for chunk in stream:
            yield sse(chunk)
    except Interrupted:
        log.info("a stream was ended at the shutdown deadline")
        yield sse(_shutdown_error(grace_s).to_dict())
    except ApiError as e:
        yield sse(e.to_dict())
    except Exception as e:  # an engine failure: this request fails, the server goes on
        log.exception("stream failed")
        yield sse(ApiError(500, f"internal error: {type(e).__name__}").to_dict())
    finally:
        with anyio.CancelScope(shield=True):  # a closed connection still aborts the engine request
            await stream.aclose()
        if on_end is not None:
            on_end(stream)
    yield SSE_DONE


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServer:
    """The app's state: the settings, the engine boot, the routes once the engine is ready, the
    metrics, and the drain: after SIGTERM, requests in flight get SHUTDOWN_GRACE_S, then end with a
    503 (a stream: with an error event)."""

    def __init__(self, settings: Settings, boot: EngineBoot, metrics: Metrics | None = None):
        self.settings = settings
        self.boot = boot
        self.metrics = metrics or Metrics()
        self._routes: OpenAIRoutes | None = None
        self.draining = False
        self.drained = asyncio.Event()  # set when the grace period is over
        self.streams: set[ChunkStream] = set()  # the streaming responses being sent

    async def routes(self) -> OpenAIRoutes:
        if self._routes is None:
            try:
                engine = await self.boot.ready()
            except Exception as e:
                raise ApiError(503, f"the model failed to load: {e}") from None
            if self._routes is None:
                self._routes = OpenAIRoutes(
                    TimedEngine(engine, on_queue_wait=self.metrics.observe_queue_wait),
                    self.settings,
                    self.boot.served_names,
                    self.metrics,
                )
        return self._routes

    def begin_drain(self) -> None:
        """uvicorn stops accepting connections; what is in flight gets the grace period."""
        if self.draining:
            return
        self.draining = True
        grace = self.settings.shutdown_grace_s
        log.info(
            "shutting down: %d stream(s) and the requests in flight get %gs to finish "
            "(SHUTDOWN_GRACE_S)",
            len(self.streams),
            grace,
        )
        asyncio.get_running_loop().call_later(grace, self._grace_over)

    def _grace_over(self) -> None:
        self.drained.set()
        for stream in list(self.streams):
            stream.interrupt()

    async def handle(self, request: Request, route: str) -> Response:
        """One OpenAI request: parse, dispatch, answer JSON or SSE; a client that leaves aborts the
        work."""
        try:
            body = (
                await read_json_body(request, self.settings.max_request_bytes)
                if request.method == "POST"
                else {}
            )
            if self.drained.is_set():
                raise _shutdown_error(self.settings.shutdown_grace_s)
            routes = await self.routes()
            result = await self._answer(request, routes.dispatch(route, body))
        except ClientLeft:
            from handler.http_connection import READ_TIMEOUT_KEY

            if not request.scope.get(READ_TIMEOUT_KEY):  # a read timeout was logged already
                log.info(
                    "%s %s: the client left before its request body was in", request.method, route
                )
            return Response(status_code=499)
        except ApiError as e:
            return _error_response(e)
        except Exception as e:  # a bug or an engine failure: this request fails, the server goes on
            log.exception("request failed")
            return _error_response(ApiError(500, f"internal error: {type(e).__name__}"))
        if isinstance(result, Response):
            return result
        if isinstance(result, ChunkStream):
            self.streams.add(result)
            if self.drained.is_set():
                result.interrupt()
            body = _sse_body(result, self.settings.shutdown_grace_s, on_end=self.streams.discard)
            return StreamingResponse(
                body,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(result)

    async def _answer(self, request: Request, dispatch):
        """The dispatch's result, unless the client leaves (499) or the grace period ends (503)
        first: then the work is cancelled, which aborts its engine request."""
        work = asyncio.ensure_future(dispatch)
        gone = asyncio.ensure_future(_until_disconnect(request))
        drained = asyncio.ensure_future(self.drained.wait())
        try:
            await asyncio.wait({work, gone, drained}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left = gone.done()
            gone.cancel()
            drained.cancel()
        if work.done():
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        if left:
            log.info(
                "%s: the client left before the answer; its request was aborted",
                request.url.path[:200],
            )
            return Response(status_code=499)
        raise _shutdown_error(self.settings.shutdown_grace_s)

    def health(self) -> Response:
        failed = self.boot.failed
        engine = self.boot.engine_now()
        if failed is not None:
            return JSONResponse({"status": "failed", "error": str(failed)}, status_code=503)
        if engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if engine.errored is not None:
            return JSONResponse(
                {"status": "failed", "error": f"engine: {type(engine.errored).__name__}"},
                status_code=503,
            )
        return JSONResponse({"status": "ok", "models": self.boot.served_names})

    async def metrics_text(self) -> Response:
        engine = self.boot.engine_now()
        stats = None
        if engine is not None and engine.errored is None:
            stats = engine.stats_nowait()  # plain reads: /metrics never waits for an engine step
        text = self.metrics.render(
            stats, ready=engine is not None, engine=engine, cold_start=self.boot.phases
        )
        return Response(text, media_type=PROMETHEUS_CONTENT_TYPE)


def build_app(settings: Settings, boot: EngineBoot, metrics: Metrics | None = None) -> Starlette:
    """The ASGI app: the OpenAI routes (also under /openai), /health, /ping and /metrics.
    Starlette, not FastAPI: every route takes the raw request and validates it itself, so FastAPI's
    import and its analysis of each route would only be start-up work (bench/start_profile.py
    shows it)."""
    server = OpenAIServer(settings, boot, metrics)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        boot.start()
        yield
        engine = boot.engine_now()
        if engine is not None:
            engine.shutdown()
            await asyncio.to_thread(boot.join_background, BACKGROUND_JOIN_S)

    def endpoint_for(route: str):
        async def endpoint(request: Request) -> Response:
            return await server.handle(request, route)

        return endpoint

    async def health(request: Request) -> Response:
        return server.health()

    async def ping(request: Request) -> Response:
        """RunPod load-balancing endpoints probe /ping: 204 while loading, 200 when ready, 503 when
        dead."""
        response = server.health()
        return Response(status_code=204) if b'"loading"' in response.body else response

    async def metrics_endpoint(request: Request) -> Response:
        return await server.metrics_text()

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            error = ApiError(
                404,
                f"route {request.url.path[:200]!r} does not exist; the routes are "
                f"{', '.join(ROUTES)} (also under /openai), /health and /metrics",
            )
        elif exc.status_code == 405:
            error = ApiError(
                405, f"method {request.method} is not allowed on {request.url.path[:200]!r}"
            )
        else:
            error = ApiError(exc.status_code, str(exc.detail))
        return _error_response(error)

    routes = [
        Route(prefix + route, endpoint_for(route), methods=[ROUTE_METHODS[route]])
        for prefix in ("", "/openai")
        for route in ROUTES
    ]
    routes += [
        Route("/health", health, methods=["GET"]),
        Route("/ping", ping, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(_RequestTarget)],
        exception_handlers={StarletteHTTPException: http_error},
        lifespan=lifespan,
    )
    # No trailing-slash redirects (Starlette builds them from the Host header): _RequestTarget
    # answers the route.
    app.router.redirect_slashes = False
    app.state.server = server
    return app


class _RequestTarget:
    """ASGI middleware: a request target (path and query) over MAX_REQUEST_LINE_BYTES is a 414;
    one trailing slash is dropped, so `/v1/completions/` answers as `/v1/completions` (never a
    redirect)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path_bytes = scope.get("raw_path") or scope["path"].encode()
            target = len(path_bytes) + len(scope.get("query_string", b""))
            if target > MAX_REQUEST_LINE_BYTES:
                error = ApiError(
                    414,
                    f"request target: {target} bytes exceeds the limit of "
                    f"{MAX_REQUEST_LINE_BYTES} bytes",
                )
                await _error_response(error)(scope, receive, send)
                return
            path = scope["path"]
            if len(path) > 1 and path.endswith("/"):
                scope = {**scope, "path": path[:-1]}
        await self.app(scope, receive, send)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _watch(boot: EngineBoot, server, app_server: OpenAIServer) -> None:
    """Start the drain once uvicorn is told to stop (SIGTERM, SIGINT); and since a dead engine (a
    fatal CUDA error, say) can't serve again, stop the server then: the process exits non-zero."""
    while not server.should_exit:
        await asyncio.sleep(WATCH_SECONDS)
        engine = boot.engine_now()
        if boot.failed is not None:
            dead = f"the model failed to load: {boot.failed}"
        elif engine is not None and engine.errored is not None:
            dead = f"the engine is dead ({type(engine.errored).__name__})"
        else:
            continue
        log.error("%s: stopping the server", dead)
        server.engine_dead = True
        server.should_exit = True
    app_server.begin_drain()


def _stop_on_signals(server) -> None:
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, under the handlers it found:
    with these, the re-raised signal only asks for the stop already done, so the process exits with
    serve()'s status (0 after a clean drain) rather than by the signal (143). Before uvicorn runs,
    they stop it as soon as it starts."""

    def stop(signum, frame) -> None:
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def serve(settings: Settings, host: str, port: int, boot: EngineBoot | None = None) -> int:
    """Run the server until SIGINT/SIGTERM (graceful: in-flight requests get SHUTDOWN_GRACE_S,
    then end with an error; exit 0) or a dead engine (exit 1). boot: the engine's start if already
    begun (handler.__main__); None: begin it here."""
    import uvicorn

    from handler.http_connection import uvicorn_config

    boot = boot or EngineBoot(settings).start()  # load while uvicorn starts
    app = build_app(settings, boot)
    sock = _bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn_config(app, settings))
    server.engine_dead = False
    _stop_on_signals(server)

    async def run() -> None:
        watcher = asyncio.ensure_future(_watch(boot, server, app.state.server))
        try:
            await server.serve(sockets=[sock])
        finally:
            watcher.cancel()

    print(
        f"coldbrew: OpenAI server on http://{bound_host}:{bound_port}/v1 (health: /health)",
        flush=True,
    )
    asyncio.run(run())
    return 1 if server.engine_dead else 0


def main(argv: list[str] | None = None, boot: EngineBoot | None = None) -> None:
    """boot: the engine's start, already begun by the entry point before this module's imports (its
    settings are the server's); None: load the settings and begin it here."""
    ap = argparse.ArgumentParser(prog="python -m handler serve", description=__doc__)
    ap.add_argument(
        "--host", help="address to listen on (default: 0.0.0.0 if PORT is set, else 127.0.0.1)"
    )
    ap.add_argument(
        "--port", type=int, help="port to listen on; 0 picks a free one (default: PORT, else 8000)"
    )
    args = ap.parse_args(argv)
    if boot is None:
        try:
            boot = begin(load_settings())
        except SettingsError as e:
            print(f"coldbrew: {e}", file=sys.stderr)
            sys.exit(2)
    settings = boot.settings
    # RunPod load-balancing endpoints set PORT (and PORT_HEALTH): listen on every interface.
    host = args.host or ("0.0.0.0" if settings.port else "127.0.0.1")
    port = args.port if args.port is not None else settings.port or 8000
    if settings.port_health not in (None, port):
        from handler.health_port import HealthPort

        if port == 0:
            sys.exit("coldbrew: PORT_HEALTH needs the server's port: give --port a number, not 0")
        try:
            HealthPort(host, settings.port_health, host, port).start()
        except OSError as e:
            sys.exit(f"coldbrew: PORT_HEALTH={settings.port_health}: cannot listen on {host}: {e}")
    code = serve(settings, host, port, boot)
    # Out without finalising the interpreter, as the worker does: a daemon thread still inside
    # torch, Triton or the CUDA driver (a decode graph's capture, a tokenizer) would meet the
    # teardown (a segfault at exit); the logs are flushed first.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
