"""Engine configuration: EngineArgs (what the caller asks for) and ModelConfig (an HF config.json
normalised).

ModelConfig reads both spellings transformers has used for rope settings; engine.model_support
refuses what the engine cannot run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from cache.loader import DTYPE_NAMES
from engine.attention.kv_quant import check_kv_cache_dtype
from engine.checkpoint_quant import CheckpointFp8, checkpoint_quantization
from engine.family_configs import (
    gemma3_rope_settings,
    hidden_activation,
    language_model_config,
    layer_windows,
    local_layers,
    with_top_level_rope_keys,
)
from engine.model_support import SUPPORTED_ARCHITECTURES, check_model_config, rope_settings  # noqa: F401 (decoder.py reads it here)
from engine.moe_config import MoeConfig, read_moe_config
from engine.quant import check_quantization

_DTYPES = {setting: getattr(torch, name) for setting, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # longrope (Phi-3): per-frequency divisors below and above original_max_position_embeddings,
    # the cos/sin scale (None: HF's default from the length ratio), and the context the engine
    # serves, which picks one set for every position (None: max_position_embeddings).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    serving_len: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The few numbers the decoder template needs, whatever the family."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 / Qwen2.5
    qk_norm: bool  # Qwen3, Gemma 3: per-head RMSNorm on q and k before RoPE
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    # --- Phi-3 and Gemma 3 switches (defaults: the Llama template) ---
    rotary_dim: int | None = None  # rotate the first rotary_dim dims of a head (None: all)
    layer_windows: tuple[int | None, ...] = ()  # per-layer window (empty: sliding_window for all)
    local_layers: tuple[int, ...] = ()  # the windowed kind of an interleaved model (Gemma 3's)
    local_rope: RopeConfig | None = None  # rope of the local layers (Gemma 3's own base)
    hidden_act: str = "silu"  # the MLP gate's activation
    attn_scale: float | None = None  # softmax scale (None: head_dim ** -0.5)
    embed_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(hidden))
    gemma_norms: bool = False  # (1 + w) RMSNorms, norms after attention and MLP too
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    moe: MoeConfig | None = None  # Qwen2/Qwen3-MoE, Mixtral: the sparse MLP (engine/moe_config.py)
    # An FP8 checkpoint's weight format (engine/checkpoint_quant.py); None: unquantized weights.
    checkpoint_fp8: CheckpointFp8 | None = None

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def serving(self, max_model_len: int) -> "ModelConfig":
        """This config for an engine serving contexts up to max_model_len: longrope then takes one
        set of factors for every position (long ones when max_model_len passes
        original_max_position_embeddings), so cached keys never mix the two."""
        if self.rope.rope_type != "longrope":
            return self
        return dataclasses.replace(
            self, rope=dataclasses.replace(self.rope, serving_len=max_model_len)
        )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch, family = check_model_config(cfg)  # as the cache checks it before fetching weights
        cfg = language_model_config(cfg)  # a multimodal checkpoint's text decoder
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # Mistral's default window is 4096 when the key is absent; Qwen applies a window only when
        # asked to.
        sliding = cfg.get("sliding_window", 4096 if family == "mistral" else None)
        if family in ("qwen2", "qwen3"):
            sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        elif family in ("qwen2_moe", "qwen3_moe"):
            sliding = None  # refused when asked for (model_support)
        num_layers = int(cfg["num_hidden_layers"])
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        window = int(sliding) if sliding else None
        if window is not None and window >= max_positions:  # never reached: no mask to apply
            window = None
        local = local_layers(cfg, family, num_layers)
        gemma = family.startswith("gemma")
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_read_rope(cfg, family, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2"
            or bool(cfg.get("attention_bias", False))
            or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True))),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            sliding_window=window,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            rotary_dim=_rotary_dim(cfg, family, int(head_dim)),
            layer_windows=layer_windows(local, family, num_layers, window),
            local_layers=local,
            local_rope=(
                _rope_from(gemma3_rope_settings(cfg)[1], max_positions)
                if family == "gemma3"
                else None
            ),
            hidden_act=hidden_activation(cfg, family),
            attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
            embed_scale=hidden**0.5 if gemma else 1.0,
            gemma_norms=gemma,
            attn_softcap=_positive_or_none(cfg, "attn_logit_softcapping"),
            final_softcap=_positive_or_none(cfg, "final_logit_softcapping"),
            moe=read_moe_config(cfg, family),
            checkpoint_fp8=checkpoint_quantization(cfg),
        )

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model: no config.json in {model_dir!r}")
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _read_rope(cfg: dict[str, Any], family: str, max_positions: int) -> RopeConfig:
    """Rope settings live in `rope_parameters` (transformers 5), or before that in `rope_theta`
    and `rope_scaling`; Gemma 3's global layers read theirs from the per-layer-kind settings."""
    if family == "gemma3":
        return _rope_from(gemma3_rope_settings(cfg)[0], max_positions)
    merged = with_top_level_rope_keys(cfg, rope_settings(cfg))
    merged.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return _rope_from(merged, max_positions)


def _rope_from(settings: dict[str, Any], max_positions: int) -> RopeConfig:
    """A RopeConfig from one rope settings dict (rope_theta included)."""
    merged = rope_settings({"rope_parameters": settings})
    theta = merged.get("rope_theta", 10000.0)
    attention_factor = merged.get("attention_factor")
    if merged["rope_type"] == "longrope" and attention_factor is None:
        attention_factor = _longrope_attention_factor(merged, max_positions)
    return RopeConfig(
        theta=float(theta),
        rope_type=merged["rope_type"],
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
        short_factor=tuple(float(f) for f in merged.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in merged.get("long_factor") or ()),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def _positive_or_none(cfg: dict[str, Any], field: str) -> float | None:
    """A soft-cap: None when absent or null; ValueError naming `field` unless positive."""
    value = cfg.get(field)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{field}: must be a positive number or null, got {value!r}")
    return float(value)


def _longrope_attention_factor(settings: dict[str, Any], max_positions: int) -> float:
    """The cos/sin scale longrope applies when the config names none (as transformers computes it):
    sqrt(1 + ln(factor) / ln(original length)), factor defaulting to the ratio of lengths."""
    original = settings.get("original_max_position_embeddings") or max_positions
    factor = settings.get("factor") or max_positions / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _rotary_dim(cfg: dict[str, Any], family: str, head_dim: int) -> int | None:
    """How many dims of each head rotate (`partial_rotary_factor`, at the top level or in the rope
    settings); None for all. Raises ValueError when longrope's factor lists do not match it."""
    settings = {} if family == "gemma3" else with_top_level_rope_keys(cfg, rope_settings(cfg))
    factor = float(settings.get("partial_rotary_factor") or 1.0)
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(
            f"partial_rotary_factor: {factor} of head_dim {head_dim} must give an even number of "
            "dims in (0, head_dim]"
        )
    if settings.get("rope_type") == "longrope":
        if not settings.get("original_max_position_embeddings"):
            raise ValueError("original_max_position_embeddings: longrope needs it")
        for name in ("short_factor", "long_factor"):
            if len(settings.get(name) or ()) != rotary_dim // 2:
                raise ValueError(
                    f"{name}: longrope needs {rotary_dim // 2} factors (rotary dims / 2), "
                    f"got {len(settings.get(name) or ())}"
                )
    return None if rotary_dim == head_dim else rotary_dim


def resolve_dtype(
    dtype: str | torch.dtype, model: ModelConfig, device: torch.device
) -> torch.dtype:
    """'auto' takes the checkpoint's dtype on a GPU and float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(str(model.torch_dtype), torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


# Decode batches are padded up to the next of these sizes and replayed from a CUDA graph; bigger
# ones run eager.
DEFAULT_CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
MAX_CUDA_GRAPH_SIZE = 1024

CUDA_GRAPH_CAPTURE_MODES = ("lazy", "start")
KV_SIZING_MODES = ("analytic", "profile")

MAX_TENSOR_PARALLEL_SIZE = 8  # the GPUs of one host
ALL_REDUCE_BACKENDS = ("nccl", "symm_mem")

# CPU has no "free memory" to size from: without num_kv_blocks the KV cache takes this many bytes.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class EngineArgs:
    """Everything the engine is built from. The handler turns env vars into these; the engine reads
    no env."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # On CPU (and when num_kv_blocks is None) the KV cache gets this budget in bytes.
    cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    seed: int = 0
    chat_template: str | None = None
    # No tokenizer at start (vLLM's flag): prompts are token ids and outputs carry token ids only,
    # no text; stop strings are refused. The caller detokenizes (engine.output_text). A grammar
    # request loads the tokenizer then, for its token table.
    skip_tokenizer_init: bool = False
    # Weights: "auto" loads the engine-ready pack when one matches, else safetensors and writes the
    # pack (under pack_dir, default <model>/packs); "pack" fails if the pack can't be written;
    # "safetensors" never uses packs.
    load_format: str = "auto"
    pack_dir: str | None = None
    # CUDA graphs (GPU only) for decode steps and, cut at attention, for prompt and mixed steps
    # (engine/piecewise_graphs.py): off when True, as vLLM's flag. The decode batch sizes
    # captured, padded to: None takes DEFAULT_CUDA_GRAPH_SIZES up to max_num_seqs.
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    # GPU start-up: "lazy" captures a decode graph on the first step of its padded size, and a
    # prompt step's token bucket on its second step (the start skips the capture), "start" captures
    # every size and bucket before the engine is ready. Graph memory is budgeted either way.
    cuda_graph_capture: str = "lazy"
    # GPU KV sizing: "analytic" subtracts an upper bound of the largest step's activations computed
    # from the model's shapes (engine/memory_budget.py); "profile" runs that step once at start and
    # measures its peak.
    kv_sizing: str = "analytic"
    # The largest step's peak bytes as measured by a profiled start on this GPU (a compiled engine's
    # KV-sizing record): used, with the analytic bound's margins, instead of that bound; no profiled
    # step. None: as kv_sizing.
    kv_step_bytes: int | None = None
    # Schedule and launch step N+1 before step N's sampled tokens are read back (as vLLM's async
    # scheduling): None turns it on for a GPU and off for CPU.
    async_scheduling: bool | None = None
    # Tensor parallelism: the model split over this many GPUs of one host (one process each, started
    # by the engine; on CPU, processes over gloo). all_reduce_backend: "nccl", or "symm_mem"
    # (torch's symmetric-memory all-reduce for decode-sized messages, NCCL for the rest; NCCL alone
    # where the machine can't map peer memory).
    tensor_parallel_size: int = 1
    all_reduce_backend: str = "nccl"
    # Weights: None serves the checkpoint's dtype; "fp8" quantizes the linears of a bf16/fp16
    # checkpoint to FP8 (e4m3, per output channel) as it loads, activations per token at run time
    # (engine/quant; GPUs of compute capability >= 8.9, or CPU).
    quantization: str | None = None
    # The paged KV cache's dtype (KV_CACHE_DTYPE): "auto" is the model's dtype; "fp8" / "fp8_e4m3"
    # store e4m3, "fp8_e5m2" e5m2 (engine/attention/kv_quant.py): half the bytes per token.
    kv_cache_dtype: str = "auto"

    def validate(self) -> None:
        _check_int("block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1, 1 << 24)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1, 1 << 30)
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        _check_int("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes, 1, 1 << 50)
        _check_int("max_num_seqs", self.max_num_seqs, 1, 1 << 20)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager: must be a bool, got {self.enforce_eager!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling: must be a bool or None, got {self.async_scheduling!r}"
            )
        if self.cuda_graph_sizes is not None:
            if not isinstance(self.cuda_graph_sizes, (list, tuple)) or not self.cuda_graph_sizes:
                raise ValueError(
                    "cuda_graph_sizes: must be a non-empty list of ints, "
                    f"got {self.cuda_graph_sizes!r}"
                )
            for size in self.cuda_graph_sizes:
                _check_int("cuda_graph_sizes", size, 1, MAX_CUDA_GRAPH_SIZE)
        if self.cuda_graph_capture not in CUDA_GRAPH_CAPTURE_MODES:
            raise ValueError(
                f"cuda_graph_capture: must be one of {', '.join(CUDA_GRAPH_CAPTURE_MODES)}, "
                f"got {self.cuda_graph_capture!r}"
            )
        if self.kv_step_bytes is not None:
            _check_int("kv_step_bytes", self.kv_step_bytes, 0, 1 << 50)
        if self.kv_sizing not in KV_SIZING_MODES:
            raise ValueError(
                f"kv_sizing: must be one of {', '.join(KV_SIZING_MODES)}, got {self.kv_sizing!r}"
            )
        check_quantization(self.quantization)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, MAX_TENSOR_PARALLEL_SIZE)
        if self.all_reduce_backend not in ALL_REDUCE_BACKENDS:
            choices = ", ".join(ALL_REDUCE_BACKENDS)
            raise ValueError(
                f"all_reduce_backend: must be one of {choices}, got {self.all_reduce_backend!r}"
            )
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.tensor_parallel_size > 1 and ":" in self.device:
            raise ValueError(
                f"device: {self.device!r} names one GPU, but tensor_parallel_size "
                f"{self.tensor_parallel_size} runs rank i on cuda:i; use cuda or auto"
            )

    def graph_sizes(self) -> list[int]:
        """The decode batch sizes to capture, ascending, none above max_num_seqs."""
        sizes = (
            self.cuda_graph_sizes if self.cuda_graph_sizes is not None else DEFAULT_CUDA_GRAPH_SIZES
        )
        return sorted(
            {s for s in sizes if s <= self.max_num_seqs}
            or {min(self.max_num_seqs, MAX_CUDA_GRAPH_SIZE)}
        )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not (lo <= value <= hi):
        raise ValueError(f"{name}: must be an integer in [{lo}, {hi}], got {value!r}")
