"""coldbrew's paged-KV inference engine: continuous batching, chunked prefill, prefix caching.

Knows nothing about RunPod, environment variables or S3. Public API: LLM, AsyncLLM, EngineArgs,
SamplingParams.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Names resolve on first use, so importing one engine module does not import them all.
_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncLLM": "engine.llm",
    "EngineArgs": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # the same names for type checkers ("X as X": a re-export)
    from engine.config import EngineArgs as EngineArgs
    from engine.llm import LLM as LLM, AsyncLLM as AsyncLLM
    from engine.outputs import (
        CompletionOutput as CompletionOutput,
        Logprob as Logprob,
        RequestOutput as RequestOutput,
    )
    from engine.sampling_params import SamplingParams as SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
