"""The HTTP connections of `python -m handler serve`: uvicorn's h11 protocol with its cap on the
request line and headers (h11_max_incomplete_event_size), plus the read timeouts uvicorn lacks: a
request whose headers or body arrive too slowly gets a 408 and its connection is closed, with one
info line in the log.
"""

from __future__ import annotations

import json
import logging
import math

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from handler.limits import KEEP_ALIVE_S, MAX_HEADER_BYTES
from handler.protocol import ApiError

log = logging.getLogger("handler.server")

# Set on the request's ASGI scope when its body timed out: the app knows it was logged here.
READ_TIMEOUT_KEY = "coldbrew.read_timeout"
# After the shutdown grace period, the longest uvicorn waits for the error events to go out.
SHUTDOWN_FLUSH_S = 10


class TimedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with read deadlines: the request line and headers must arrive within
    `header_timeout_s` of the connection's start (or of the first byte of a later request on it),
    the body within `body_timeout_s` of the headers. Trickling bytes does not extend either."""

    header_timeout_s = 10.0
    body_timeout_s = 60.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._read_timer = None
        self._timed_phase: str | None = None
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _stop_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer, self._timed_phase = None, None

    def _follow(self) -> None:
        """Arm, move or stop the read deadline from where the client is in its request. Waiting for
        headers (IDLE) is timed only from a new connection or a first byte: an idle kept-alive
        connection is uvicorn's to close."""
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._timed_phase or self.transport.is_closing():
            return
        self._stop_timer()
        if phase is not None:
            limit = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._timed_phase = phase
            self._read_timer = self.loop.call_later(limit, self._expired, phase, limit)

    def _expired(self, phase: str, limit: float) -> None:
        self._read_timer, self._timed_phase = None, None
        if self.transport.is_closing():
            return
        client = "%s:%d" % self.client if self.client else "a client"
        setting = "HTTP_HEADER_TIMEOUT_S" if phase == "headers" else "HTTP_BODY_TIMEOUT_S"
        log.info(
            "closed the connection from %s: the request %s did not arrive within %gs (%s)",
            client,
            phase,
            limit,
            setting,
        )
        cycle = self.cycle if phase == "body" else None
        if cycle is None or not cycle.response_started:
            self._send_408(f"request {phase}: not received within {limit:g} s ({setting})")
        if cycle is not None:
            cycle.scope[READ_TIMEOUT_KEY] = phase  # type: ignore[literal-required]
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _send_408(self, message: str) -> None:
        body = json.dumps(ApiError(408, message).to_dict()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            response = h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")
            out = self.conn.send(response)
            out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # a response already began: closing is all that is left
            return
        self.transport.write(out)


def uvicorn_config(app, settings) -> uvicorn.Config:
    """uvicorn's settings for the server: h11 with the header cap and read deadlines, keep-alive,
    and a graceful shutdown that outlasts SHUTDOWN_GRACE_S (the app ends its own streams then;
    uvicorn cancels only stragglers)."""
    protocol = type(
        "SettingsTimedH11Protocol",
        (TimedH11Protocol,),
        {
            "header_timeout_s": settings.http_header_timeout_s,
            "body_timeout_s": settings.http_body_timeout_s,
        },
    )
    graceful_s = math.ceil(settings.shutdown_grace_s) + SHUTDOWN_FLUSH_S
    return uvicorn.Config(
        app,
        http=protocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=graceful_s,
        log_level=settings.log_level.lower(),
        access_log=settings.log_level == "DEBUG",
        lifespan="on",
        ws="none",  # no WebSocket routes: uvicorn then imports no WebSocket library at start
    )
