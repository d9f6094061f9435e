"""Fused Triton kernels of the CUDA fast path: residual-add + RMSNorm (Llama's, or Gemma's (1 + w)),
the MLP's gate activation times up (SiLU, or Gemma's GELU), RoPE (+ Qwen3's or Gemma's per-head q/k
norm, KV write).

Each kernel rounds to the activation dtype where the torch reference does, so results match it
within bf16 rounding. The norm and the gate activation can also write their rows quantized for an
FP8 linear after them (rms_norm_fp8, gate_and_mul_fp8): e4m3 values with one fp32 scale per row,
amax / 448 of the row rounded to the activation dtype, exactly what quantizing the kernel's
ordinary output per token gives (engine.quant.fp8_kernels.quantize_per_token), in one launch.
"""

from __future__ import annotations

import torch

from engine.pdl import launch_options, release

try:  # a CPU-only install may have no triton; the torch reference layers never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None


def fused_kernels_available(x: torch.Tensor) -> bool:
    """True when x lives on a CUDA device and triton is importable: the layers then take the fused
    kernels."""
    return triton is not None and x.is_cuda


if triton is not None:
    from engine.norm_rounding import weighted_norm

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        scale_ptr,
        stride_x,
        stride_res,
        stride_out,
        stride_res_out,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        OFFSET: tl.constexpr,
        QUANTIZE: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """OFFSET: Gemma's norm, normalised(x) * (1 + w) in float32 and rounded once; else Llama's,
        normalised(x) rounded to the activation dtype, then times w. QUANTIZE: out_ptr is e4m3,
        written with the row's scale at scale_ptr (quantize_row)."""
        release(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            # the sum is rounded to the activation dtype before the norm, as `x + residual` does in
            # torch
            x = (x.to(tl.float32) + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # the norm's output, in the activation dtype
        y = weighted_norm(xf, 1.0 / tl.sqrt(var + eps), w, OFFSET, x_ptr.dtype.element_ty)
        if QUANTIZE:
            quantize_row(y.to(tl.float32), out_ptr + row * stride_out, scale_ptr + row, cols, mask)
        else:
            tl.store(out_ptr + row * stride_out + cols, y, mask=mask)

    @triton.jit
    def quantize_row(y, q_ptr, scale_ptr, cols, mask):
        """A whole row y (float32, its lanes outside the row 0) as e4m3 at q_ptr + cols, and its
        scale at scale_ptr (e4m3_scale, e4m3_values)."""
        scale = e4m3_scale(tl.max(tl.abs(y), axis=0))
        tl.store(scale_ptr, scale)
        tl.store(q_ptr + cols, e4m3_values(y, scale, q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def e4m3_scale(amax):
        """Per-token quantization's scale of a row whose largest magnitude is amax: amax / 448 (an
        all-zero row gets a finite one), as engine.quant.fp8_kernels.quantize_rows_reference."""
        return tl.maximum(amax, 1e-12) / 448.0

    @triton.jit
    def e4m3_values(y, scale, E4M3: tl.constexpr):
        """y / scale clamped to e4m3's range and cast to it."""
        return tl.clamp(y / scale, -448.0, 448.0).to(E4M3)

    @triton.jit
    def gate_activation(gate, ACT: tl.constexpr):
        """act(gate) in float32, ACT a GATE_ACTIVATIONS code: SiLU, GELU's tanh form, GELU's erf
        (also the one-row GEMV's prologue, engine.layers.row_gemv)."""
        if ACT == 0:
            return gate / (1.0 + tl.exp(-gate))
        elif ACT == 1:  # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))); tanh u = 1 - 2/(e^2u + 1)
            u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
        else:
            return 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))

    @triton.jit
    def _gate_and_mul_kernel(
        x_ptr,
        out_ptr,
        stride_x,
        stride_out,
        n_cols,
        ACT: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """act(gate) * up; ACT: GATE_ACTIVATIONS' code (SiLU, GELU's tanh form, GELU's erf)."""
        release(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _gated(x_ptr + row * stride_x, cols, mask, n_cols, ACT)
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)

    @triton.jit
    def _gated(row_ptr, cols, mask, n_cols, ACT: tl.constexpr):
        """act(gate) * up at `cols` of one [gate | up] row, in the row's dtype: the activation
        rounded to it before the product, as torch's act(gate) * up does."""
        gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        act = gate_activation(gate, ACT).to(row_ptr.dtype.element_ty).to(tl.float32)
        return (act * up).to(row_ptr.dtype.element_ty)

    @triton.jit
    def _gate_and_mul_fp8_kernel(
        x_ptr,
        q_ptr,
        scale_ptr,
        stride_x,
        stride_q,
        n_cols,
        ACT: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program r: row r's act(gate) * up as e4m3 with its scale (quantize_row's numerics): a
        first pass over the row for its amax, a second computing it again to quantize."""
        release(PDL)
        row = tl.program_id(0).to(tl.int64)
        row_ptr = x_ptr + row * stride_x
        cols = tl.arange(0, BLOCK)
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            mask = c0 + cols < n_cols
            peak = tl.maximum(peak, tl.abs(_gated(row_ptr, c0 + cols, mask, n_cols, ACT)))
        scale = e4m3_scale(tl.max(peak, axis=0))
        tl.store(scale_ptr + row, scale)
        for c0 in range(0, n_cols, BLOCK):
            mask = c0 + cols < n_cols
            y = _gated(row_ptr, c0 + cols, mask, n_cols, ACT).to(tl.float32)
            q = e4m3_values(y, scale, q_ptr.dtype.element_ty)
            tl.store(q_ptr + row * stride_q + c0 + cols, q, mask=mask)

    @triton.jit
    def _rotate_heads(
        src_ptr,
        stride_src_tok,
        dst_row,
        norm_w_ptr,
        cos,
        sin,
        tok,
        num_heads,
        eps,
        store_ok,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HAS_NORM: tl.constexpr,
        NORM_OFFSET: tl.constexpr,
    ):
        """Rotate the num_heads heads of one token ([BLOCK_H, HALF] tiles of both halves) and store
        them densely from dst_row (when store_ok)."""
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (dims < HALF)
        base = src_ptr + tok * stride_src_tok + heads * HEAD_DIM + dims
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        dtype = dst_row.dtype.element_ty
        if HAS_NORM:  # Qwen3, Gemma 3: per-head RMSNorm over head_dim, before the rotation
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM
            rstd = (1.0 / tl.sqrt(var + eps))[:, None]
            w1 = tl.load(norm_w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(norm_w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
            x1 = weighted_norm(f1, rstd, w1, NORM_OFFSET, dtype)
            x2 = weighted_norm(f2, rstd, w2, NORM_OFFSET, dtype)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        # every product and sum rounded to the activation dtype, as the torch reference computes it
        a = (f1 * cos).to(dtype).to(tl.float32)
        b = (f2 * sin).to(dtype).to(tl.float32)
        c = (f2 * cos).to(dtype).to(tl.float32)
        d = (f1 * sin).to(dtype).to(tl.float32)
        out = dst_row + heads * HEAD_DIM + dims
        tl.store(out, (a - b).to(dtype), mask=mask & store_ok)
        tl.store(out + HALF, (c + d).to(dtype), mask=mask & store_ok)

    @triton.jit
    def _rope_kernel(
        q_ptr,
        k_ptr,
        stride_q_tok,
        stride_k_tok,
        q_out_ptr,
        k_out_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        q_norm_ptr,
        k_norm_ptr,
        num_q_heads,
        num_kv_heads,
        eps,
        v_ptr,
        stride_v_tok,
        slot_ptr,
        stride_kv,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
        HAS_NORM: tl.constexpr,
        NORM_OFFSET: tl.constexpr,
        TO_CACHE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per token. TO_CACHE: k_out_ptr is a paged KV cache layer [2, slots, Hkv, D]
        and the rotated K and the untouched V go straight to the token's slot (a negative slot is
        padding: nothing written)."""
        release(PDL)
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        dims = tl.arange(0, BLOCK_D)[None, :]
        cos = tl.load(cos_ptr + pos * HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        _rotate_heads(
            q_ptr,
            stride_q_tok,
            q_out_ptr + tok * num_q_heads * HEAD_DIM,
            q_norm_ptr,
            cos,
            sin,
            tok,
            num_q_heads,
            eps,
            True,
            HEAD_DIM,
            HALF,
            BLOCK_D,
            BLOCK_HQ,
            HAS_NORM,
            NORM_OFFSET,
        )
        if TO_CACHE:
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            k_row = k_out_ptr + slot * num_kv_heads * HEAD_DIM
            _rotate_heads(
                k_ptr,
                stride_k_tok,
                k_row,
                k_norm_ptr,
                cos,
                sin,
                tok,
                num_kv_heads,
                eps,
                slot >= 0,
                HEAD_DIM,
                HALF,
                BLOCK_D,
                BLOCK_HK,
                HAS_NORM,
                NORM_OFFSET,
            )
            heads = tl.arange(0, BLOCK_HK)[:, None]
            full = tl.arange(0, 2 * BLOCK_D)[None, :]
            v_mask = (heads < num_kv_heads) & (full < HEAD_DIM) & (slot >= 0)
            value = tl.load(v_ptr + tok * stride_v_tok + heads * HEAD_DIM + full, mask=v_mask)
            tl.store(k_row + stride_kv + heads * HEAD_DIM + full, value, mask=v_mask)
        else:
            _rotate_heads(
                k_ptr,
                stride_k_tok,
                k_out_ptr + tok * num_kv_heads * HEAD_DIM,
                k_norm_ptr,
                cos,
                sin,
                tok,
                num_kv_heads,
                eps,
                True,
                HEAD_DIM,
                HALF,
                BLOCK_D,
                BLOCK_HK,
                HAS_NORM,
                NORM_OFFSET,
            )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, cols] view whose last dim is contiguous (copying only when it is not)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One kernel: s = x + residual (when given, rounded to x's dtype), then RMSNorm(s) * weight
    (offset: Gemma's RMSNorm(s) * (1 + weight)).

    Returns (normed, s), or (normed, None) without a residual. x and residual keep their shapes.
    """
    shape = x.shape
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = _launch_rms_norm(x2, weight, eps, residual, offset, out, None)
    return out.view(shape), (res_out.view(shape) if res_out is not None else None)


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """rms_norm_fused's norm, quantized per row in the same kernel: x [M, K] -> (e4m3 [M, K], fp32
    scales [M, 1], x + residual or None)."""
    x2 = _rows(x)
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
    res_out = _launch_rms_norm(x2, weight, eps, residual, offset, q, scale)
    return q, scale, (res_out.view(x.shape) if res_out is not None else None)


def _launch_rms_norm(x2, weight, eps, residual, offset, out, scale) -> torch.Tensor | None:
    """The norm kernel over x2's rows into out (e4m3 with `scale` given); returns x + residual
    ([rows, cols]) or None."""
    n_rows, n_cols = x2.shape
    res2 = _rows(residual) if residual is not None else None
    res_out = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device) if res2 is not None else None
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(n_rows,)](
            x2,
            res2 if res2 is not None else x2,
            weight,
            out,
            res_out if res_out is not None else x2,
            scale if scale is not None else x2,
            x2.stride(0),
            (res2 if res2 is not None else x2).stride(0),
            out.stride(0),
            (res_out if res_out is not None else x2).stride(0),
            n_cols,
            eps,
            HAS_RESIDUAL=res2 is not None,
            OFFSET=offset,
            QUANTIZE=scale is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            **launch_options(),
        )
    return res_out


# the gate activations the kernel computes (transformers' names) -> its ACT code
GATE_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


def gate_and_mul_fused(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[..., 2 * I] -> [..., I] = act(gate) * up in one kernel; activation: a GATE_ACTIVATIONS
    name."""
    x2 = _rows(gate_up)
    n_rows, width = x2.shape
    n_cols = width // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows:
        block = 1024
        _gate_and_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            n_cols,
            ACT=GATE_ACTIVATIONS[activation],
            BLOCK=block,
            num_warps=4,
            **launch_options(),
        )
    return out.view(*gate_up.shape[:-1], n_cols)


def gate_and_mul_fp8(
    gate_up: torch.Tensor, activation: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_and_mul_fused's rows quantized per row in the same kernel: [M, 2 * I] -> (e4m3 [M, I],
    fp32 scales [M, 1])."""
    x2 = _rows(gate_up)
    n_rows, n_cols = x2.shape[0], x2.shape[1] // 2
    q = torch.empty((n_rows, n_cols), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty((n_rows, 1), dtype=torch.float32, device=gate_up.device)
    if n_rows:
        block = min(4096, triton.next_power_of_2(n_cols))
        _gate_and_mul_fp8_kernel[(n_rows,)](
            x2, q, scale, x2.stride(0), q.stride(0), n_cols,
            ACT=GATE_ACTIVATIONS[activation], BLOCK=block, num_warps=8, **launch_options(),
        )  # fmt: skip
    return q, scale


def silu_and_mul_fused(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I] = silu(gate) * up in one kernel."""
    return gate_and_mul_fused(gate_up, "silu")


def rope_fused(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,
    kv_cache_layer: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    norm_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, H, D], k [T, Hkv, D] (strided views of a fused qkv output are fine) -> new contiguous
    rotated q, k.

    cos/sin are the [max_positions, D/2] caches; with norm weights, each head is RMS-normalised
    first (Qwen3; norm_offset: Gemma's (1 + w) norm). With v, kv_cache_layer [2, blocks,
    block_size, Hkv, D] (contiguous, q's dtype) and slot_mapping [T], the rotated k and v are
    written to the cache at their slots instead (as the attention backend's KV write would):
    (q, None).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1 or q.stride(-2) != head_dim:
        q = q.contiguous()
    if k.stride(-1) != 1 or k.stride(-2) != head_dim:
        k = k.contiguous()
    to_cache = kv_cache_layer is not None
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if to_cache:
        if v.stride(-1) != 1 or v.stride(-2) != head_dim:
            v = v.contiguous()
        k_out = kv_cache_layer
    else:
        k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens:
        has_norm = q_norm_weight is not None
        _rope_kernel[(num_tokens,)](
            q,
            k,
            q.stride(0),
            k.stride(0),
            q_out,
            k_out,
            positions,
            cos,
            sin,
            q_norm_weight if has_norm else cos,
            k_norm_weight if has_norm else cos,
            num_heads,
            num_kv_heads,
            eps,
            v if to_cache else q,
            v.stride(0) if to_cache else 0,
            slot_mapping if to_cache else positions,
            kv_cache_layer.stride(0) if to_cache else 0,
            HEAD_DIM=head_dim,
            HALF=head_dim // 2,
            BLOCK_D=triton.next_power_of_2(head_dim // 2),
            BLOCK_HQ=triton.next_power_of_2(num_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            HAS_NORM=has_norm,
            NORM_OFFSET=norm_offset,
            TO_CACHE=to_cache,
            num_warps=4,
            **launch_options(),
        )
    return q_out, (None if to_cache else k_out)
