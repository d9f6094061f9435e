"""Sampling parameters: SamplingParams, the validated per-request knobs (named and defaulted like
vLLM's).

Stdlib only (no torch), so request-facing code (the handler's job and route schemas) imports it at
no cost; the batched sampler that applies them lives in engine.sampling.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # tokens a request may bias
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for each bias: [-100, 100]
# vLLM asks only > 0; far below 1 a seen token's logit overflows (1e-300 gave only end-of-text).
MIN_REPETITION_PENALTY = 0.01
_U64 = 1 << 64


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _number(name: str, value: Any, requirement: str, ok: Callable[[float], bool]) -> float:
    """A finite real number (not a bool) that passes ok; returned as float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: must be a number {requirement}, got {_describe(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be finite and {requirement}, got {value!r}")
    if not ok(value):
        raise ValueError(f"{name}: must be {requirement}, got {value!r}")
    return float(value)


def _integer(
    name: str, value: Any, requirement: str, ok: Callable[[int], bool], optional: bool = False
) -> int | None:
    """An int (not a bool) that passes ok, returned as a plain int; None passes through when
    optional."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "None or an int" if optional else "an int"
        wanted = f"{kind} {requirement}" if requirement else kind
        raise ValueError(f"{name}: must be {wanted}, got {_describe(value)}")
    if not ok(value):
        raise ValueError(f"{name}: must be {requirement}, got {value!r}")
    return int(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be a bool, got {_describe(value)}")


@dataclass
class SamplingParams:
    """Per-request sampling knobs, named and defaulted like vLLM's; invalid values raise ValueError
    naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    max_tokens: int | None = None  # None: until EOS or the context limit
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> a value added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # an engine.structured_outputs.StructuredOutputs: the grammar the output must match
    structured_outputs: Any = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def validate(self) -> None:
        """Check every field, normalising stop lists, number types and the seed; the first bad one
        raises ValueError."""
        self.n = _integer("n", self.n, f"in [1, {MAX_N}]", lambda v: 1 <= v <= MAX_N)
        self.temperature = _number("temperature", self.temperature, ">= 0", lambda v: v >= 0)
        self.top_p = _number("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        self.top_k = _integer(
            "top_k", self.top_k, "-1 or >= 0 (0 and -1 disable it)", lambda v: v >= -1
        )
        self.min_p = _number("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        self.repetition_penalty = _number(
            "repetition_penalty",
            self.repetition_penalty,
            f">= {MIN_REPETITION_PENALTY}",
            lambda v: v >= MIN_REPETITION_PENALTY,
        )
        self.presence_penalty = _number(
            "presence_penalty", self.presence_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2
        )
        self.frequency_penalty = _number(
            "frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2
        )
        if self.seed is not None:
            # Any int is accepted; it is reduced into [0, 2**64) so torch.Generator.manual_seed
            # takes it.
            self.seed = _integer("seed", self.seed, "", lambda v: True) % _U64
        self._validate_stop()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        self.max_tokens = _integer(
            "max_tokens", self.max_tokens, ">= 1", lambda v: v >= 1, optional=True
        )
        self.min_tokens = _integer("min_tokens", self.min_tokens, ">= 0", lambda v: v >= 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            setattr(
                self,
                name,
                _integer(
                    name,
                    getattr(self, name),
                    f"in [0, {MAX_LOGPROBS}]",
                    lambda v: 0 <= v <= MAX_LOGPROBS,
                    optional=True,
                ),
            )

        self._validate_logit_bias()
        if self.structured_outputs is not None:
            from engine.structured_outputs import StructuredOutputs

            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError(
                    "structured_outputs: must be a StructuredOutputs, got "
                    + _describe(self.structured_outputs)[:200]
                )
            if self.min_tokens:
                raise ValueError(
                    "min_tokens: cannot be combined with structured_outputs (the grammar decides "
                    "where the output ends); leave min_tokens at 0"
                )

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(
                f"logit_bias: must be a dict of token id -> bias, got {_describe(bias)}"
            )
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        limit = LOGIT_BIAS_LIMIT
        self.logit_bias = {
            _integer("logit_bias", token, ">= 0 (each token id)", lambda v: v >= 0): _number(
                f"logit_bias[{token}]",
                value,
                f"in [-{limit:g}, {limit:g}]",
                lambda v: abs(v) <= limit,
            )
            for token, value in bias.items()
        } or None

    def _validate_stop(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise ValueError(f"stop: must be a str, a list of str or None, got {_describe(stop)}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop: each entry must be a str, got {_describe(s)}")
            if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop: each string must have 1 to {MAX_STOP_STRING_CHARS} characters, "
                    f"got {len(s)}"
                )
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (list, tuple)):
            ids = list(ids)
        else:
            raise ValueError(f"stop_token_ids: must be a list of int or None, got {_describe(ids)}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids: must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
            )
        self.stop_token_ids = [
            _integer("stop_token_ids", t, ">= 0 (each id)", lambda v: v >= 0) for t in ids
        ]
