"""The local endpoint: an emulator of a RunPod serverless endpoint that starts and stops real worker
processes (`python -m handler`) by queue depth, from zero, through scaling.policy.decide().

Rooms: `config` (its settings), `jobs` (the job queue), `leases` (what workers take and report),
`workers` (their processes), `scaler` (how many there should be), `state` (what the routes work
with), `server` (the lifecycle), `app` with `routes_queue`, `routes_openai` and `routes_worker`
(HTTP), `protocol` (what routes share), `cli` (`python -m scaling.endpoint`).
"""

from scaling.endpoint.cli import main
from scaling.endpoint.config import EndpointConfig
from scaling.endpoint.server import Endpoint

__all__ = ["Endpoint", "EndpointConfig", "main"]
