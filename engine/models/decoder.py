"""The one decoder template (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3), readable top to
bottom, with per-family switches.

Switches come from ModelConfig: qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3), explicit
head_dim, tied lm_head, experts in place of the MLP (Qwen2/Qwen3-MoE, Mixtral:
engine/layers/moe.py), partial rotary and longrope (Phi-3), per-layer windows and rope (Gemma 3,
Qwen's max_window_layers), Gemma's (1 + w) norms around attention and MLP, GELU gate, scaled
embeddings and query_pre_attn_scalar, Gemma 2's soft-capped scores and logits.

Under tensor parallelism (a Shard of more than one rank) each rank builds its slice: qkv and gate_up
keep its rows (heads, MLP columns), o_proj and down_proj its input columns and all-reduce, the
embedding and lm_head its rows of the vocabulary; hf_weight_map says which slice of each HF tensor a
rank holds.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, RotaryTables
from engine.attention.kv_quant import DEFAULT_KV_SCALE, is_fp8
from engine.config import ModelConfig
from engine.distributed.sharding import SINGLE, Shard
from engine.layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from engine.layers.fused_linears import (
    NormedRow,
    act_linear,
    linear_add_norm,
    norm_linear,
    one_row_gated,
    one_row_linear,
)
from engine.layers.moe import SparseMoeBlock
from engine.layers.norm import OffsetRMSNorm
from engine.layers.parallel import RowParallelLinear, VocabParallelEmbedding
from engine.layers.rotary import norm_operands
from engine.layers.skinny_gemm import skinny_applies, skinny_gemm
from engine.models.checkpoint_names import is_vision_tensor, text_decoder_name
from engine.models.moe_weights import moe_weight_rows
from engine.quant.base import QuantizedRows

# A piecewise capture's stand-in for every layer's attention backend (DecoderModel.
# attention_through), seen by the capturing thread only: steps on other threads meanwhile run the
# layers' own backends.
_ATTENTION_CUT = threading.local()

# Phi-3 checkpoints' fused tensors and the HF parts they stand for
_PHI3_FUSED = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)


class WeightSlot(NamedTuple):
    """Where one HF tensor goes: rows [start, end) of our parameter `param` receive the slice
    [first, first + count) along dim `dim` of the HF tensor, whose full shape is `full`."""

    param: str
    start: int
    end: int
    dim: int
    first: int
    count: int
    full: tuple[int, ...]


class Attention(nn.Module):
    """Fused qkv projection -> (q/k norm) -> RoPE -> paged attention backend -> o_proj."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend,
        dtype: torch.dtype,
        device: torch.device,
        row_linear=Linear,
        layer: int = 0,
        linear=Linear,
    ) -> None:
        """cfg: this rank's slice (engine.distributed.sharding.Shard.local_config); row_linear:
        o_proj's class; layer: its index (windows may differ per layer); linear: qkv_proj's class
        (a quantization scheme's)."""
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        self.sliding_window = cfg.window_of(layer)
        self.softcap = cfg.attn_softcap
        # An FP8 KV cache's (K, V) scales for this layer (engine.attention.kv_quant).
        self.kv_scale = DEFAULT_KV_SCALE
        self.backend = backend
        self.qkv_proj = linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, dtype, device
        )
        # Qwen2 biases only q/k/v; Llama/Mistral/Qwen3 with attention_bias bias o_proj too.
        o_bias = cfg.qkv_bias and cfg.family not in ("qwen2", "qwen2_moe")
        self.o_proj = row_linear(self.q_size, cfg.hidden_size, o_bias, dtype, device)
        if cfg.qk_norm:
            self.q_norm = norm_class(cfg)(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = norm_class(cfg)(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        heads = self.attend_heads(self.qkv_proj(x), positions, rotary, kv_cache_layer, meta)
        return one_row_linear(self.o_proj, heads)

    def attend_heads(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Everything between the qkv projection and o_proj (a caller that fused qkv with the
        norm before, and o_proj with the add and norm after): the heads [T, heads * head_dim]."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        kwargs = {"sliding_window": self.sliding_window} if self.sliding_window else {}
        if self.softcap is not None:  # Gemma 2
            kwargs["softcap"] = self.softcap
        if is_fp8(kv_cache_layer.dtype):
            kwargs["kv_scale"] = self.kv_scale
        backend = getattr(_ATTENTION_CUT, "backend", None) or self.backend
        fusable = rotary.can_write_cache(q, kv_cache_layer, self.q_norm)
        # (a piecewise capture's cut has no rotates_in_kernel)
        in_kernel = getattr(backend, "rotates_in_kernel", None)
        if fusable and in_kernel is not None and in_kernel(q, kv_cache_layer, meta):
            # decode: the attention kernel norms and rotates q and k and writes K/V itself
            norms = {} if self.q_norm is None else norm_operands(self.q_norm, self.k_norm)
            kwargs["rotary"] = RotaryTables(rotary.cos, rotary.sin, **norms)
        elif fusable and getattr(backend, "accepts_written_kv", False):
            # one kernel rotates q and k (Qwen3: normalises each head first) and stores k, v in the
            # paged cache
            q = rotary.rotate_into_cache(
                positions, q, k, v, kv_cache_layer, meta.slot_mapping, self.q_norm, self.k_norm
            )
            kwargs["kv_written"] = True
        else:
            # Qwen3 normalises each head before rotating
            q, k = rotary(positions, q, k, self.q_norm, self.k_norm)
        out = backend.forward(q, k, v, kv_cache_layer, meta, self.scale, **kwargs)
        return out.reshape(T, self.q_size)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection (act: SiLU, Gemma's
    GELU)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        row_linear=Linear,
        linear=Linear,
    ) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.activation = cfg.hidden_act
        self.gate_up_proj = linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, dtype, device)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_linear(self.down_proj, self.gate_up_proj(x), self.activation)

    def norm_forward(
        self,
        norm: RMSNorm,
        h: torch.Tensor | NormedRow,
        residual: torch.Tensor | None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor | NormedRow, torch.Tensor | None]:
        """(mlp(norm(h + residual)), h + residual). At batch-1 decode the activation closes
        gate_up's kernel, which takes the norm too for bf16 weights (engine.layers.fused_linears:
        one_row_gated), so that down reads act(gate) * up; else the norm goes with gate_up and the
        activation with down (norm_linear, act_linear). h may be a NormedRow (its norm begun by
        o_proj); with next_norm, down begins that norm on its output the same way and returns
        (NormedRow, None) where it can (engine.layers.fused_linears.linear_add_norm)."""
        gated = one_row_gated(norm, self.gate_up_proj, h, residual, self.activation)
        if gated is not None:
            act, residual = gated
            return linear_add_norm(self.down_proj, act, residual, next_norm)
        gate_up, residual = norm_linear(norm, self.gate_up_proj, h, residual)
        return act_linear(self.down_proj, gate_up, self.activation), residual


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), with the running sum carried as
    `residual`.

    Each residual add is fused with the norm that follows it:
    norm(x, residual) -> (normed, x + residual).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        backend,
        dtype: torch.dtype,
        device: torch.device,
        row_linear=Linear,
        layer: int = 0,
        linear=Linear,
        experts=None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, backend, dtype, device, row_linear, layer, linear)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if cfg.moe is not None and cfg.moe.is_sparse(layer):  # experts (engine/layers/moe.py)
            self.mlp = SparseMoeBlock(cfg, dtype, device, experts)
        else:
            self.mlp = MLP(cfg, dtype, device, row_linear, linear)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor | NormedRow, torch.Tensor | None]:
        """(this layer's MLP output, the residual stream before it); their sum is the layer's
        output. Each norm is taken with the projection after it (engine.layers.fused_linears: one
        kernel at batch-1 decode). There, with a dense MLP, the projection before each norm also
        begins it (o_proj the MLP's; down `next_norm`, the next layer's), and the layer returns
        (NormedRow, None), the sum inside; x may be one (residual None)."""
        attn = self.self_attn
        qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, x, residual)
        heads = attn.attend_heads(qkv, positions, rotary, kv_cache_layer, meta)
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, MLP):
            h, residual = linear_add_norm(attn.o_proj, heads, residual, norm)
            return self.mlp.norm_forward(norm, h, residual, next_norm)
        # the norm goes with the experts' router (engine/layers/moe.py), or is begun by o_proj
        if self.mlp.takes_normed_row(heads):
            h, residual = linear_add_norm(attn.o_proj, heads, residual, norm)
        else:
            h = one_row_linear(attn.o_proj, heads)
        return self.mlp.norm_forward(norm, h, residual, next_norm)


class SandwichDecoderLayer(nn.Module):
    """Gemma's block, each sublayer normed before and after:
    x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x))), with
    (1 + w) norms; the same (output, residual) contract as DecoderLayer."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend,
        dtype: torch.dtype,
        device: torch.device,
        row_linear=Linear,
        layer: int = 0,
        linear=Linear,
    ) -> None:
        super().__init__()

        def norm() -> OffsetRMSNorm:
            return OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, backend, dtype, device, row_linear, layer, linear)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.mlp = MLP(cfg, dtype, device, row_linear, linear)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed MLP output, the residual stream before it). The norms before qkv
        and gate_up are taken with their projections (engine.layers.fused_linears: one kernel at
        batch-1 decode), as DecoderLayer's are. next_norm is not begun here: the output is
        post_feedforward_layernorm's, not a linear's."""
        attn = self.self_attn
        qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, x, residual)
        heads = attn.attend_heads(qkv, positions, rotary, kv_cache_layer, meta)
        h = self.post_attention_layernorm(one_row_linear(attn.o_proj, heads))
        out, residual = self.mlp.norm_forward(self.pre_feedforward_layernorm, h, residual)
        return self.post_feedforward_layernorm(out), residual


def norm_class(cfg: ModelConfig) -> type[RMSNorm]:
    """Gemma's (1 + w) RMSNorm or the Llama one."""
    return OffsetRMSNorm if cfg.gemma_norms else RMSNorm


class DecoderModel(nn.Module):
    """Token ids of one ragged step -> final-normed hidden states; compute_logits maps them to the
    vocabulary.

    Parameter names are HF's without the "model." prefix, except the fused `qkv_proj` and
    `gate_up_proj`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        backend,
        param_device: torch.device | str | None = None,
        shard: Shard = SINGLE,
        comm=None,
        quant=None,
    ) -> None:
        """param_device="meta" builds the parameters without memory (a loader then points them into
        its own buffer); buffers (the rotary cos/sin tables) always live on `device`.

        shard: the slice this rank holds; comm: its collectives
        (engine.distributed.comm.Communicator; a shard without one can load, not run); quant: an
        engine.quant.QuantConfig whose linears serve attention's qkv/o and the MLP's gate_up/down
        (embeddings, lm_head, norms and MoE routers stay in `dtype`)."""
        super().__init__()
        shard.check(cfg)
        device = torch.device(device)
        params_on = torch.device(param_device) if param_device is not None else device
        self.config = cfg
        self.shard = shard
        self.comm = comm
        self.dtype = dtype
        self.quant = quant
        vocab_rows = cfg.vocab_size
        row_linear = linear = Linear
        if shard.size > 1:
            first, _, vocab_rows = shard.vocab(cfg)
            self.embed_tokens = VocabParallelEmbedding(
                first, vocab_rows, cfg.hidden_size, dtype, params_on, comm
            )
            row_linear = functools.partial(RowParallelLinear, comm=comm)
        else:
            self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, params_on)
        experts = {}
        if quant is not None:
            quant.check_model(cfg)
            linear = quant.linear
            row_linear = functools.partial(quant.linear, comm=comm, row_parallel=shard.size > 1)
            if cfg.moe is not None:  # check_model refused a scheme without experts
                experts = {"experts": quant.experts}
        local = shard.local_config(cfg)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope, cfg.max_position_embeddings, dtype, device, cfg.rotary_dim
        )
        # Gemma 3's local layers rotate with their own base
        self.local_rotary = (
            None
            if cfg.local_rope is None
            else RotaryEmbedding(
                cfg.head_dim, cfg.local_rope, cfg.max_position_embeddings, dtype, device
            )
        )
        self.register_buffer(
            "embed_scale", torch.tensor(cfg.embed_scale, dtype=dtype, device=device), False
        )
        layer_class = SandwichDecoderLayer if cfg.gemma_norms else DecoderLayer
        self.layers = nn.ModuleList(
            layer_class(local, backend, dtype, params_on, row_linear, i, linear, **experts)
            for i in range(cfg.num_layers)
        )
        self.norm = norm_class(cfg)(cfg.hidden_size, cfg.rms_norm_eps, dtype, params_on)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, vocab_rows, False, dtype, params_on)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64; kv_cache [L, 2, blocks, block_size, Hkv, D]
        -> hidden [T, hidden]."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # rounded to the model dtype, as HF Gemma scales
            x = x * self.embed_scale
        residual = None
        # each layer is told the next one's input norm, which its down may begin
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [None]
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            x, residual = layer(
                x, residual, positions, self.rotary_of(i), kv_cache[i], meta, next_norm
            )
        if residual is None:
            return self.norm(x)
        return self.norm(x, residual)[0]

    @contextlib.contextmanager
    def attention_through(self, backend) -> Iterator[None]:
        """Inside the block every layer's attention called from this thread calls `backend`
        (engine.piecewise_graphs ends one graph and begins the next there); the layers' own
        backend after it, and all along on other threads (a step that runs while a bucket is
        captured in the background)."""
        previous = getattr(_ATTENTION_CUT, "backend", None)
        _ATTENTION_CUT.backend = backend
        try:
            yield
        finally:
            _ATTENTION_CUT.backend = previous

    def rotary_of(self, layer: int) -> RotaryEmbedding:
        """The rotary embedding of layer `layer` (Gemma 3's local layers have their own)."""
        if self.local_rotary is not None and layer in self.config.local_layers:
            return self.local_rotary
        return self.rotary

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (written into `out` [N, vocab] when
        given), soft-capped where the model asks (Gemma 2: cap * tanh(logits / cap))."""
        logits = self._vocab_logits(hidden, out)
        cap = self.config.final_softcap
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _vocab_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The lm_head's projection of compute_logits, before any soft-cap."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.shard.size > 1:  # each rank's vocabulary rows, gathered in the model dtype (rounded
            if self.comm is None:  # as TP=1 rounds them)
                raise RuntimeError(
                    "tensor parallel: this model holds one rank's shard and has no communicator"
                )
            skinny = skinny_applies(hidden, weight)
            local = skinny_gemm(hidden, weight) if skinny else F.linear(hidden, weight)
            logits = self.comm.gather_vocab(local)[:, : self.config.vocab_size]
            return logits.float() if out is None else out.copy_(logits)
        # decode: bf16-rounded logits straight into out
        if out is not None and skinny_applies(hidden, weight):
            return skinny_gemm(hidden, weight, out=out)
        logits = F.linear(hidden, weight)
        if out is None:
            return logits.float()
        return out.copy_(logits)

    # --- HF checkpoint names -> this model's (fused, sharded) parameters
    # ------------------------------------

    def hf_weight_map(self) -> dict[str, WeightSlot]:
        """HF tensor name -> the WeightSlot saying which slice of it this rank holds, and where."""
        cfg, shard, d = self.config, self.shard, self.config.head_dim
        q_first, q_heads = shard.q_heads(cfg)
        kv_first, kv_heads = shard.kv_heads(cfg)
        i_first, inter = shard.intermediate(cfg)
        v_first, v_rows, _ = shard.vocab(cfg)
        q, kv = q_heads * d, kv_heads * d
        params = dict(self.named_parameters())
        out: dict[str, WeightSlot] = {}

        def rows(hf: str, ours: str, start: int, count: int, first: int, total: int) -> None:
            """Rows [first, first + count) of an HF tensor of `total` rows -> our rows
            [start, start + count)."""
            if ours in params:
                full = (total, *params[ours].shape[1:])
                out[hf] = WeightSlot(ours, start, start + count, 0, first, count, full)

        def columns(hf: str, ours: str, first: int, total: int) -> None:
            """Columns [first, first + ours' width) of an HF tensor of `total` columns -> all of our
            rows."""
            if ours in params:
                n, width = params[ours].shape
                out[hf] = WeightSlot(ours, 0, n, 1, first, width, (n, total))

        def whole(hf: str, ours: str) -> None:
            if ours in params:
                n = params[ours].shape[0]
                out[hf] = WeightSlot(ours, 0, n, 0, 0, n, tuple(params[ours].shape))

        rows("model.embed_tokens.weight", "embed_tokens.weight", 0, v_rows, v_first, cfg.vocab_size)
        rows("lm_head.weight", "lm_head.weight", 0, v_rows, v_first, cfg.vocab_size)
        whole("model.norm.weight", "norm.weight")
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            for kind in ("weight", "bias"):
                fused = f"{ours}.self_attn.qkv_proj.{kind}"
                q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
                rows(f"{hf}.self_attn.q_proj.{kind}", fused, 0, q, q_first * d, q_rows)
                rows(f"{hf}.self_attn.k_proj.{kind}", fused, q, kv, kv_first * d, kv_rows)
                rows(f"{hf}.self_attn.v_proj.{kind}", fused, q + kv, kv, kv_first * d, kv_rows)
            columns(
                f"{hf}.self_attn.o_proj.weight",
                f"{ours}.self_attn.o_proj.weight",
                q_first * d,
                cfg.num_heads * d,
            )
            whole(f"{hf}.self_attn.o_proj.bias", f"{ours}.self_attn.o_proj.bias")
            gate_up = f"{ours}.mlp.gate_up_proj.weight"
            rows(f"{hf}.mlp.gate_proj.weight", gate_up, 0, inter, i_first, cfg.intermediate_size)
            rows(f"{hf}.mlp.up_proj.weight", gate_up, inter, inter, i_first, cfg.intermediate_size)
            columns(
                f"{hf}.mlp.down_proj.weight",
                f"{ours}.mlp.down_proj.weight",
                i_first,
                cfg.intermediate_size,
            )
            for hf_name, ours_name, start, count in moe_weight_rows(cfg, i):
                if ours_name in params:  # experts, router, shared expert: rows of our parameter
                    full = (count, params[ours_name].shape[-1])
                    out[hf_name] = WeightSlot(ours_name, start, start + count, 0, 0, count, full)
            for name in (
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
                "pre_feedforward_layernorm.weight",
                "post_feedforward_layernorm.weight",
            ):
                whole(f"{hf}.{name}", f"{ours}.{name}")
        # Phi-3's checkpoints hold them fused already, in our order (q, k, v; gate, up)
        if cfg.family == "phi3":
            for i in range(cfg.num_layers):
                for fused, parts in _PHI3_FUSED:
                    for part in parts:
                        out.pop(f"model.layers.{i}.{part}.weight")
                        out.pop(f"model.layers.{i}.{part}.bias", None)
                    whole(f"model.layers.{i}.{fused}.weight", f"layers.{i}.{fused}.weight")
        return out

    @torch.no_grad()
    def load_hf_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], presliced: bool = False
    ) -> None:
        """Copy HF-named tensors into our parameters (slices of the fused ones), casting to the
        model dtype.

        Each tensor is whole (this rank's slice is cut here), or with presliced=True already its
        slice (as iter_safetensors(..., slots) reads them). Raises ValueError for a shape mismatch,
        for unknown tensors, and, at the end, for unfilled parameters. The vocabulary rows past the
        real ones (a shard's padding) are zeros.
        """
        weight_map = self.hf_weight_map()
        params = dict(self.named_parameters())
        quantized = self.quantized_linears()
        seen: set[str] = set()
        unknown: list[str] = []
        for name, tensor in named_tensors:
            name = text_decoder_name(name)  # a multimodal checkpoint's text decoder
            slot = weight_map.get(name)
            if slot is None:
                if not _ignorable(name, self.config):
                    unknown.append(name)
                continue
            if not presliced:
                shape = tuple(tensor.shape)
                if shape != slot.full:
                    raise ValueError(
                        f"weights: {name} has shape {shape} but the model expects {slot.full}"
                    )
                tensor = tensor.narrow(slot.dim, slot.first, slot.count)
            dest = _rows_of(params[slot.param])[slot.start : slot.end]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(
                    f"weights: {name} has shape {tuple(tensor.shape)} "
                    f"but the model expects {tuple(dest.shape)}"
                )
            if slot.param in quantized:  # whole rows: each output channel quantized with its scale
                quantized[slot.param].load_weight_rows(slot.start, slot.end, tensor)
            elif isinstance(tensor, QuantizedRows):  # an FP8 checkpoint's rows, into a plain one
                dest.copy_(tensor.dequantize())
            else:
                dest.copy_(tensor)
            seen.add(name)
        if unknown:
            raise ValueError(
                f"weights: unexpected tensors for {self.config.architecture}: {_few(unknown)}"
            )
        missing = sorted(set(weight_map) - seen)
        if missing:
            raise ValueError(f"weights: missing tensors: {_few(missing)}")
        self.zero_vocab_padding()

    def quantized_linears(self) -> dict:
        """Weight parameter name -> what quantizes high-precision rows into place (and fills random
        ones): each quantized linear (engine.quant.base.QuantizedLinear), and each parameter a
        module lists in quantized_parameters() (a scheme's stacked experts)."""
        from engine.quant.base import QuantizedLinear

        out = {}
        for name, m in self.named_modules():
            if isinstance(m, QuantizedLinear):
                out[f"{name}.weight"] = m
            listed = getattr(m, "quantized_parameters", None)
            if listed is not None:
                out.update({f"{name}.{param}": rows for param, rows in listed().items()})
        return out

    @torch.no_grad()
    def zero_vocab_padding(self) -> None:
        """Zero the rows of the embedding table and lm_head past the vocabulary (the last shard's
        padding)."""
        _, real, _ = self.shard.vocab(self.config)
        for table in (self.embed_tokens, self.lm_head):
            if table is not None and table.weight.shape[0] > real:
                table.weight[real:].zero_()


def _rows_of(param: torch.Tensor) -> torch.Tensor:
    """A parameter as the rows a WeightSlot counts: stacked experts [E, R, C] as [E * R, C]."""
    return param.flatten(0, -2) if param.dim() > 2 else param


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the engine does not need."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if is_vision_tensor(name):  # a multimodal checkpoint's vision tower: text only here
        return cfg.architecture.endswith("ForConditionalGeneration")
    return name == "lm_head.weight" and cfg.tie_word_embeddings


def _few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    more = f" ... ({len(names)} in all)" if len(names) > limit else f" ({len(names)} in all)"
    return shown + more


def build_model(
    model_config: ModelConfig,
    dtype: torch.dtype | str,
    device: torch.device | str,
    attn_backend=None,
    param_device: torch.device | str | None = None,
    shard: Shard = SINGLE,
    comm=None,
    quant=None,
) -> DecoderModel:
    """An empty (unloaded) DecoderModel with parameters allocated once, on `device` (or
    `param_device`), in `dtype`; under tensor parallelism, the slice `shard` of it, with its
    collectives through `comm`; quant: an engine.quant.QuantConfig or its EngineArgs name ("fp8"),
    refused here for a GPU or model it can't serve."""
    from engine.config import SUPPORTED_ARCHITECTURES, resolve_dtype

    if model_config.family not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(
            f"model family {model_config.family!r} is not supported: "
            f"supported are {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    device = torch.device(device)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, model_config, device)
    if attn_backend is None or isinstance(attn_backend, str):
        from engine.attention import select_backend

        attn_backend = select_backend(device, attn_backend or "auto")
    if quant is None or isinstance(quant, str):
        from engine.quant import quant_config

        quant = quant_config(quant)
    if quant is not None:
        quant.check_device(device)
    return DecoderModel(
        model_config, dtype, device, attn_backend, param_device, shard, comm, quant
    ).eval()
