"""The local endpoint's HTTP app (FastAPI): RunPod's queue API, its OpenAI-compatible route and the
workers' job routes, served for one endpoint's state (kept in app.state; the routes get it as a
dependency).
"""

from __future__ import annotations

from fastapi import FastAPI

from scaling.endpoint import routes_openai, routes_queue, routes_worker
from scaling.endpoint.protocol import BadRequest, bad_request_handler
from scaling.endpoint.state import EndpointState


def build_app(endpoint: EndpointState) -> FastAPI:
    app = FastAPI(title="coldbrew local endpoint", docs_url=None, redoc_url=None)
    app.state.endpoint = endpoint
    app.add_exception_handler(BadRequest, bad_request_handler)
    for routes in (routes_queue, routes_openai, routes_worker):
        app.include_router(routes.router)
    return app
