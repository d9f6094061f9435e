"""Every limit on what one request may carry, or how slowly it may arrive, in one place (docs/api.md
lists them). Both faces (the HTTP server and RunPod jobs) enforce the same values; the engine checks
its own again.
"""

from __future__ import annotations

from engine.sampling_params import (
    MAX_LOGPROBS as MAX_TOP_LOGPROBS,  # chat top_logprobs, completions logprobs
    MAX_N,  # samples per prompt
    MAX_STOP_STRING_CHARS as MAX_STOP_CHARS,  # characters of one stop string
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,  # vLLM asks only > 0; far below 1 the output degenerates
)

__all__ = [  # the engine's limits above are re-exported with the handler's own
    "KEEP_ALIVE_S",
    "MAX_BATCH_PROMPTS",
    "MAX_CHOICES",
    "MAX_HEADER_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_MESSAGES",
    "MAX_N",
    "MAX_REPETITION_PENALTY",
    "MAX_REQUEST_LINE_BYTES",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOOLS",
    "MAX_TOKENS_LIMIT",
    "MAX_TOP_LOGPROBS",
    "MIN_REPETITION_PENALTY",
]

# ---- the HTTP connection (python -m handler serve) ------------------------------------------
# Request line plus headers, in bytes: the server's HTTP parser (h11) refuses a larger header block
# with a 400 and closes the connection before buffering more.
MAX_HEADER_BYTES = 32 << 10
# The request target (path and query string), in bytes: 414 above.
MAX_REQUEST_LINE_BYTES = 8 << 10
# The body's limit is the setting MAX_REQUEST_BYTES (16 MiB unless set); the read timeouts are the
# settings HTTP_HEADER_TIMEOUT_S and HTTP_BODY_TIMEOUT_S. An idle kept-alive connection is closed
# after this many seconds.
KEEP_ALIVE_S = 5

# ---- the request's JSON ---------------------------------------------------------------------
# Containers (objects and lists) nested in one request body (for a job: in the OpenAI body it
# stands for), checked by an explicit-stack walk before anything else reads the request.
MAX_JSON_DEPTH = 64

# ---- the fields -----------------------------------------------------------------------------
# The engine's own limits on sampling fields (engine.sampling_params, torch-free, imported above),
# taken as they are so the two can never disagree, and the handler's own:
MAX_CHOICES = 1024  # prompts x n in one completions request
MAX_MESSAGES = 4096
MAX_TOOLS = 512  # tools offered in one chat request
MAX_BATCH_PROMPTS = 256  # prompts in one completions request
# max_tokens, max_completion_tokens, min_tokens (the context limit applies as well)
MAX_TOKENS_LIMIT = 1 << 24
# repetition_penalty divides a seen token's positive logit (multiplies a negative one): 0.01
# already multiplies a seen token's logit by 100, and above 10 a seen token is all but banned.
MAX_REPETITION_PENALTY = 10.0
