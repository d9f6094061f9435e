"""The worker's settings: every environment variable it reads, in one validated, documented
pydantic class.

`load_settings()` reads them once at start (RunPod worker-vllm's variables as
handler/worker_vllm_env.json says) and raises SettingsError with one line for each variable it
cannot honour, naming it and what it allows.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from cache.early_stream import DEFAULT_BASE_PATH, cache_dir_for
from handler import worker_vllm_env


class SettingsError(ValueError):
    """An environment variable holds a value the worker can't use; the message names it and the
    allowed values."""


_TOKEN_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_token_count(text: str) -> int | str:
    """'32k' -> 32000, '32K' -> 32768 (binary suffixes take whole numbers only), as vLLM reads
    --max-model-len; anything else is returned for pydantic to parse (and refuse)."""
    m = _TOKEN_COUNT.fullmatch(text.strip())
    if m is None:
        return text
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise ValueError(
            f"{text.strip()!r}: a binary suffix ({suffix}) takes a whole number; "
            f"{number}{suffix.lower()} is decimal"
        )
    return int(number) << (10 * "KMGT".index(suffix) + 10)


class Settings(BaseModel):
    """Every variable the worker reads. Field `foo_bar` is the environment variable FOO_BAR
    (case-insensitive); an empty value counts as unset, as RunPod templates often leave them.
    load_settings() reads the environment into it (a plain pydantic model: pydantic-settings'
    sources would be an import at start for a mapping this module already builds)."""

    model_config = ConfigDict(extra="ignore", validate_default=True)

    # ---- the model -------------------------------------------------------------------------------
    model_name: str | None = Field(
        None,
        description=(
            "Model to serve: an HF Hub repo id, s3://bucket/prefix, or a local directory. "
            "Unset: the embedded SmolLM2-135M-Instruct demo model."
        ),
    )
    model_revision: str | None = Field(
        None, description="Hub branch, tag or commit of MODEL_NAME (default: main)."
    )
    tokenizer_name: str | None = Field(
        None, description="Tokenizer to use instead of the model's own (same forms as MODEL_NAME)."
    )
    tokenizer_revision: str | None = Field(None, description="Hub revision of TOKENIZER_NAME.")
    hf_token: SecretStr | None = Field(
        None, description="Hugging Face token for gated or private models (never logged)."
    )
    custom_chat_template: str | None = Field(
        None,
        description="Jinja chat template (or path to a .jinja file) replacing the model's own.",
    )

    # ---- the engine ------------------------------------------------------------------------------
    max_model_len: int | None = Field(
        None,
        ge=1,
        le=1 << 24,
        description=(
            "Longest sequence (prompt + output) in tokens; 32k is 32000 and 32K 32768, as vLLM "
            "reads them. Unset (or auto, 0, -1): the model's max_position_embeddings, capped by "
            "what the KV cache holds."
        ),
    )
    gpu_memory_utilization: float = Field(
        0.95,
        gt=0.0,
        le=1.0,
        description=("Fraction of GPU memory the engine may use (weights + KV cache), in (0, 1]."),
    )
    max_num_seqs: int = Field(
        256, ge=1, le=1 << 20, description="Most sequences decoded in one step."
    )
    max_num_batched_tokens: int = Field(
        8192,
        ge=1,
        le=1 << 24,
        description=(
            "Token budget of one engine step (chunked prefill splits longer prompts); "
            "0 counts as unset."
        ),
    )
    block_size: int = Field(
        16, ge=1, le=1024, description="Tokens per KV-cache block; a power of two."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of shared prompt prefixes."
    )
    dtype: Literal["auto", "bfloat16", "float16", "half", "float32", "float"] = Field(
        "auto",
        description=(
            "Weight and activation dtype. auto: the checkpoint's dtype on GPU, float32 on CPU."
        ),
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description=(
            "KV cache dtype. auto: the model's dtype; fp8 / fp8_e4m3: FP8 e4m3 (about twice the "
            "tokens in the same memory; scale 1.0, as vLLM's default); fp8_e5m2: FP8 e5m2. FP8 "
            "needs a GPU of compute capability 8.9+ (L4, L40S, H100) and TENSOR_PARALLEL_SIZE 1."
        ),
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Where the engine runs. auto: CUDA if present, else CPU."
    )
    seed: int = Field(0, description="Engine seed for requests that give none.")
    engine_mode: Literal["jit", "compiled", "auto"] = Field(
        "auto",
        description=(
            "jit: eager + Triton kernels compiled on first use; compiled: a prebuilt engine for "
            "this GPU; auto: compiled when a matching artifact exists, else jit."
        ),
    )

    enforce_eager: bool = Field(
        False, description="Run every step eagerly, without CUDA graphs (as vLLM's flag)."
    )
    async_scheduling: bool | None = Field(
        None,
        description=(
            "Schedule and launch the next step before the last one's tokens are read back (as "
            "vLLM's flag). Unset: on for a GPU, off on CPU."
        ),
    )
    load_format: Literal["auto", "pack", "safetensors"] = Field(
        "auto",
        description=(
            "Weights: auto loads the engine-ready pack when one matches, else safetensors (and "
            "writes the pack); pack: fail if the pack can't be used; safetensors: never use packs."
        ),
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=8,
        description=(
            "GPUs the model is split over (tensor parallelism, one process per GPU, all started "
            "by the worker)."
        ),
    )

    quantization: Literal["fp8"] | None = Field(
        None,
        description=(
            "fp8: the linears of a bf16/fp16 checkpoint stored as FP8 (e4m3, a scale per output "
            "channel, quantized once as the pack is written), activations quantized per token; "
            "a mixture-of-experts model's experts FP8 too (weights only); "
            "needs an Ada or Hopper GPU (compute capability 8.9+). Unset: the checkpoint's dtype "
            "(FP8 checkpoints, compressed-tensors or fp8, are served as FP8 without it). awq, "
            "gptq, bitsandbytes and other schemes are refused."
        ),
    )

    # ---- the worker ------------------------------------------------------------------------------
    max_concurrency: int = Field(
        300,
        ge=1,
        le=100_000,
        description=(
            "Most jobs one worker takes at once (admission also waits for free KV capacity)."
        ),
    )
    default_batch_size: int = Field(
        50,
        ge=1,
        le=1_000_000,
        description=("Tokens per streamed chunk of a non-OpenAI job, once grown to full size."),
    )
    default_min_batch_size: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description=("Tokens in the first streamed chunk of a non-OpenAI job."),
    )
    default_batch_size_growth_factor: float = Field(
        3.0,
        ge=1.0,
        le=1000.0,
        description=(
            "Each streamed chunk holds this many times the tokens of the previous one, up to "
            "DEFAULT_BATCH_SIZE."
        ),
    )
    raw_openai_output: bool = Field(
        True,
        description=(
            "Stream OpenAI-route jobs as raw SSE strings (data: {...}) instead of JSON objects."
        ),
    )
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 24,
        description=(
            "max_tokens of requests that give none. "
            "Unset: whatever context remains after the prompt."
        ),
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description=("Logging level of the worker.")
    )

    # ---- the OpenAI surface ----------------------------------------------------------------------
    openai_served_model_name_override: str | None = Field(
        None,
        description=(
            "Model name the OpenAI routes answer to and list, "
            "besides MODEL_NAME and the local path."
        ),
    )
    openai_response_role: str = Field(
        "assistant",
        min_length=1,
        max_length=64,
        description=("Role of the generated message in chat completions."),
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "none"] | None = Field(
        None,
        description=(
            "How tool calls are read from a reply (tool_choice auto): hermes (Qwen2.5, Qwen3, "
            "Hermes), llama3_json (Llama 3.1-3.3), mistral. Unset: from the chat template; none: "
            "no parser (tool_choice auto is refused; required and named choices still work)."
        ),
    )
    enable_auto_tool_choice: bool | None = Field(
        None,
        description=(
            "Let the model decide whether to call a tool (tool_choice auto, the default with "
            "tools). Unset: on when TOOL_CALL_PARSER is set or the chat template shows a format."
        ),
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1", "none"] | None = Field(
        None,
        description=(
            "Split <think>...</think> into reasoning_content: qwen3 or deepseek_r1. Unset: from "
            "the chat template; none: the thinking stays in content."
        ),
    )
    generation_config: Literal["auto", "vllm"] = Field(
        "auto",
        description=(
            "auto: sampling fields a request leaves unset take the model's generation_config.json "
            "values (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM does; vllm: "
            "vLLM's neutral defaults."
        ),
    )
    max_request_bytes: int = Field(
        16 << 20,
        ge=1024,
        le=1 << 30,
        description=("Largest HTTP request body the OpenAI server accepts, in bytes (413 above)."),
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Port of `python -m handler serve`, listening on 0.0.0.0 (RunPod load-balancing "
            "endpoints set it). Unset: 127.0.0.1:8000. --host and --port win over it."
        ),
    )
    port_health: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Second port where `serve` answers the load balancer's /ping (204 loading, 200 ready, "
            "503 failed). Unset: /ping on PORT only."
        ),
    )
    health_check_path: Literal["/ping"] = Field(
        "/ping",
        description=("Path RunPod's load balancer polls for health; coldbrew answers it at /ping."),
    )
    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description=(
            "Seconds the OpenAI server waits for a request's line and headers, from the "
            "connection's start or the request's first byte (408 and closed after)."
        ),
    )
    http_body_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description=(
            "Seconds the OpenAI server waits for a whole request body once the headers are in "
            "(408 and closed after)."
        ),
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description=(
            "After SIGTERM, seconds in-flight requests and jobs get to finish; then streams end "
            "with an error event, jobs with an error, and the process exits 0."
        ),
    )

    # ---- the cache -------------------------------------------------------------------------------
    base_path: str = Field(
        DEFAULT_BASE_PATH,
        description=("Network-volume mount; model snapshots are cached under it when it exists."),
    )
    cache_dir: str | None = Field(
        None,
        description=(
            "Snapshot cache directory. "
            "Unset: BASE_PATH/coldbrew-cache if BASE_PATH exists, else ~/.cache/coldbrew."
        ),
    )
    baked_model_dir: str | None = Field(
        None,
        description=(
            "Snapshot (or cache root) baked into the image at build time; "
            "looked up before anything else."
        ),
    )
    cache_verify: Literal["size", "full"] = Field(
        "size",
        description=(
            "How a cached snapshot is checked at start: size (every file's size, instant) or full "
            "(sha256 of every file); a snapshot that fails is quarantined and fetched again."
        ),
    )
    s3_cache_uri: str | None = Field(
        None, description="s3://bucket/prefix of a shared snapshot cache (optional)."
    )
    s3_cache_push: bool = Field(
        True,
        description=(
            "Push snapshots fetched from the source to S3_CACHE_URI so other workers start from it."
        ),
    )
    s3_endpoint_url: str | None = Field(
        None, description="Endpoint of an S3-compatible store (R2, MinIO, ...)."
    )
    aws_access_key_id: SecretStr | None = Field(
        None, description="S3 access key id (never logged)."
    )
    aws_secret_access_key: SecretStr | None = Field(
        None, description="S3 secret access key (never logged)."
    )
    aws_region: str | None = Field(None, description="Region of the S3 bucket (e.g. us-east-1).")

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _token_count(cls, value: Any) -> Any:
        return parse_token_count(value) if isinstance(value, str) else value

    @field_validator("quantization", mode="before")
    @classmethod
    def _quantization(cls, value: Any) -> Any:
        if not isinstance(value, str) or value.strip().lower() == "fp8":
            return value.strip().lower() if isinstance(value, str) else value
        raise ValueError(
            "this scheme is not supported: fp8 quantizes a bf16/fp16 checkpoint's weights at "
            "start; FP8 checkpoints (compressed-tensors, fp8) need no setting, their "
            "quantization_config is read; other quantized checkpoints are refused"
        )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two (1, 2, 4, ..., 1024)")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("s3_cache_uri")
    @classmethod
    def _s3_uri(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("s3://"):
            raise ValueError("must look like s3://bucket/prefix")
        return value

    # ---- derived values --------------------------------------------------------------------------
    @classmethod
    def env_names(cls) -> list[str]:
        """Every environment variable the worker reads, in declaration order."""
        return [name.upper() for name in cls.model_fields]

    @classmethod
    def env_table(cls) -> list[tuple[str, str, str]]:
        """(NAME, default as text, description) for each variable: docs/configuration.md's table and
        hub.json are built from it."""
        rows = []
        for name, field in cls.model_fields.items():
            default = field.default
            shown = (
                ""
                if default is None
                else str(default).lower()
                if isinstance(default, bool)
                else str(default)
            )
            rows.append((name.upper(), shown, field.description or ""))
        return rows

    def resolved_cache_dir(self) -> Path:
        """CACHE_DIR, else BASE_PATH/coldbrew-cache when the volume is mounted, else
        ~/.cache/coldbrew."""
        return Path(cache_dir_for(self.cache_dir, self.base_path))

    def engine_options(self) -> dict[str, Any]:
        """EngineArgs fields but the model, tokenizer and device, from the settings (no torch)."""
        return dict(
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            chat_template=self.custom_chat_template,
            enforce_eager=self.enforce_eager,
            load_format=self.load_format,
            async_scheduling=self.async_scheduling,
            tensor_parallel_size=self.tensor_parallel_size,
            quantization=self.quantization,
        )

    def engine_args(
        self, model_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None
    ):
        """The engine's arguments for a model already resolved to a local directory."""
        from engine import EngineArgs

        tokenizer = str(tokenizer_dir) if tokenizer_dir is not None else None
        # ENGINE_MODE is applied by the start sequence (warmup.artifacts.prepare)
        return EngineArgs(
            model=str(model_dir), tokenizer=tokenizer, device=self.device, **self.engine_options()
        )


_ALLOWED_TEXT = {
    "block_size": "a power of two in [1, 1024]",
    "s3_cache_uri": "s3://bucket/prefix",
    "max_model_len": (
        "an integer in [1, 16777216] (or 32k, 32K), or auto/0/-1 for the model's length"
    ),
}
_SECRET_FIELDS = {
    name for name, f in Settings.model_fields.items() if "SecretStr" in str(f.annotation)
}


def _allowed(name: str) -> str:
    """What a variable accepts, in words: its type, its bounds or its choices."""
    field = Settings.model_fields[name]
    if name in _ALLOWED_TEXT:
        return _ALLOWED_TEXT[name]
    kind = field.annotation
    if get_origin(kind) is Union or isinstance(kind, UnionType):
        kind = next(a for a in get_args(kind) if a is not type(None))
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(get_args(kind))
    lo = hi = None
    lo_open = hi_open = False
    for m in field.metadata:
        if getattr(m, "ge", None) is not None:
            lo = m.ge
        if getattr(m, "gt", None) is not None:
            lo, lo_open = m.gt, True
        if getattr(m, "le", None) is not None:
            hi = m.le
        if getattr(m, "max_length", None) is not None:
            return f"a string of at most {m.max_length} characters"
    words = {
        int: "an integer",
        float: "a number",
        bool: "true or false (1/0, yes/no)",
        SecretStr: "a string",
        str: "a string",
    }.get(kind, getattr(kind, "__name__", str(kind)))
    if lo is not None and hi is not None:
        return f"{words} in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{words} {'>' if lo_open else '>='} {lo}"
    return words


def _describe_error(err: dict) -> str:
    name = str(err["loc"][0]) if err.get("loc") else ""
    msg = err["msg"].removeprefix("Value error, ")
    if name not in Settings.model_fields:
        return msg
    got = (
        ""
        if name in _SECRET_FIELDS or err.get("input") is None
        else f", got {str(err['input'])[:200]!r}"
    )
    return f"{name.upper()}: {msg}{got}; allowed: {_allowed(name)}"


def stream_env_names() -> tuple[str, ...]:
    """The variables whose values can change which weights a start streams, and to which GPU: every
    setting's and every worker-vllm alias's, and CUDA_VISIBLE_DEVICES. Secrets are left out (a hash
    of these values is kept on disk: cache.early_stream)."""
    names = {name.upper() for name in Settings.model_fields if name not in _SECRET_FIELDS}
    names |= {
        var.name
        for var in worker_vllm_env.table()
        if var.handling == "alias" and str(var.target).lower() not in _SECRET_FIELDS
    }
    return tuple(sorted(names | {"CUDA_VISIBLE_DEVICES"}))


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """The validated settings from `env` (default: os.environ). Raises SettingsError with one
    line per variable that can't be honoured: a bad value, or a worker-vllm variable that
    worker_vllm_env.json refuses."""
    translated, problems = worker_vllm_env.translate(os.environ if env is None else env)
    fields = Settings.model_fields
    values = {
        name: value
        for name, value in ((str(k).lower(), v) for k, v in translated.items())
        if name in fields and value != ""
    }
    try:
        settings = Settings.model_validate(values)
    except ValidationError as e:
        problems = [_describe_error(err) for err in e.errors()] + problems
    if problems:
        raise SettingsError("\n".join(f"invalid environment: {line}" for line in problems))
    return settings


def markdown_table() -> str:
    """The settings table of docs/configuration.md, generated from the fields (`python -m
    handler.config --markdown`)."""
    lines = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    for name, default, description in Settings.env_table():
        shown = f"`{default}`" if default else ""
        lines.append(f"| `{name}` | {shown} | {description.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m handler.config --markdown   (prints the settings table)")
    print(markdown_table(), end="")
