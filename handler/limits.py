"""Every limit on what one request may carry, or how slowly it may arrive, in one place (docs/api.md
lists them). Both faces (the HTTP server and RunPod jobs) enforce the same values; the engine checks
its own again.
"""
from __future__ import annotations

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
MAX_N = 128  # samples per prompt
MAX_CHOICES = 1024  # prompts x n in one completions request
MAX_TOP_LOGPROBS = 20  # chat top_logprobs, completions logprobs
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096
MAX_BATCH_PROMPTS = 256  # prompts in one completions request
# max_tokens, max_completion_tokens, min_tokens (the context limit applies as well)
MAX_TOKENS_LIMIT = 1 << 24
# repetition_penalty divides a seen token's positive logit (multiplies a negative one). vLLM asks
# only > 0; far below 1 the output degenerates (1e-300 overflowed the logits and gave nothing but
# end-of-text), while 0.01 already multiplies a seen token's logit by 100. Above 10 a seen token is
# all but banned already.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
