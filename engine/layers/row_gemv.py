"""The one-row GEMV of batch-1 decode: y = W x for one row x, with the elementwise op before the
linear folded in as a prologue, or the op after it as an epilogue, so that neither costs a launch.
How a decoder layer uses it (which op goes where, and when): engine/layers/fused_linears.py.

Prologues (PROLOGUE): NORM, rms_norm(x + residual) (Llama's norm or Gemma's (1 + w)); SILU_MUL and
GELU_MUL, act(gate) * up of a [gate | up] row (SiLU or Gemma's tanh GELU); NORMED, x is the scaled
row of a norm begun by the kernel before (engine.layers.fused_linears.NormedRow), its 1/rms applied
at the end. Epilogues (EPILOGUE): SILU_MUL and GELU_MUL close gate_up's kernel (each program holds
gate and up rows in pairs), so down reads act(gate) * up, half as wide; NORM adds the residual to
the output rows and begins the next norm on them: it writes s = y + residual, w * s and its
programs' sums of s^2 (row_gemv_norm_after), which a NORMED kernel then finishes.

One row of input: each program reads the whole row (from L2) beside its BLOCK_N rows of the
weight, so the prologue is recomputed per program and never written out. The norm's 1/rms is a
scalar that factors out of the dot product: W (g * x / rms) = (W (g * x)) / rms, the sum of squares
gathered in the same pass over K and applied once at the end. With a residual the first program
also writes x + residual, the stream the next layer adds to.

Weights in the activation dtype (bf16/fp16), or float8_e4m3fn with one fp32 scale per output row:
without a prologue this is the FP8 linears' one-row GEMV (engine/quant/fp8_kernels.py, "gemv").

Launch (engine.pdl): each program requests its first weight tile, then waits for the kernel before;
the kernel launches early only without a prologue (its kernel before is then small: attention, the
norm or SiLU before an FP8 linear), with NORMED (PDL_NORMED; measured faster than without), or with
any prologue when PDL_PROLOGUES (benchmarks compare).

Numerics: fp32 throughout, rounded where torch rounds the sum x + residual and the activation; the
normed input is not rounded to the activation dtype before the product (split, w * s is: the row
the second kernel reads), so results differ from the unfused layers by bf16 rounding.
Tiles: bench/row_gemv.py's sweep (default_config; TILE_OVERRIDES for a benchmark's own).
"""

from __future__ import annotations

import torch

from engine.pdl import launch_options, release

try:  # a CPU-only install may have no triton; the unfused layers never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

PDL_PROLOGUES = False  # the kernels with a prologue launch early too (benchmarks compare)
PDL_NORMED = True  # the kernels reading a NormedRow launch early (benchmarks compare)
# the prologue applied to x before the product (GELU_MUL: the tanh form, Gemma's; NORMED: x is a
# NormedRow's scaled row, its 1/rms applied at the end); as an epilogue, NORM begins the next norm
PLAIN, NORM, SILU_MUL, GELU_MUL, NORMED = 0, 1, 2, 3, 4
RowGemvConfig = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
# (prologue, weight dtype name, N, K) -> tiles replacing the defaults (a benchmark's sweep)
TILE_OVERRIDES: dict[tuple[int, str, int, int], RowGemvConfig] = {}


if triton is not None:
    from engine.layers.fused import gate_activation

    @triton.jit
    def begin_norm_rows(y, residual, g, ok):
        """The next RMSNorm begun on output elements y (EPILOGUE NORM here, the experts' down kernel
        in engine.layers.fused_moe_decode): (s = y + residual, rounded to y's dtype as torch's sum
        is; the sum of s^2 over the elements `ok`; g * s in y's dtype). g: the norm's weight in
        float32, (1 + w) for Gemma's."""
        summed = (y.to(tl.float32) + residual.to(tl.float32)).to(y.dtype)
        sf = tl.where(ok, summed.to(tl.float32), 0.0)
        return summed, tl.sum(sf * sf, axis=0), (sf * g).to(y.dtype)

    @triton.jit
    def _accumulate(
        acc, squares, w, x_ptr, res_ptr, g_ptr, res_out_ptr, k, K, pid,
        PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
        OFFSET: tl.constexpr,
    ):  # fmt: skip
        """One BLOCK_K step: acc += w * prologue(x[k]) (and the norm's sum of squares)."""
        k_ok = k < K
        if EVEN_K:
            x = tl.load(x_ptr + k)
        else:
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        if PROLOGUE == 1:  # NORM
            if HAS_RESIDUAL:
                res = tl.load(res_ptr + k, mask=k_ok, other=0.0)
                # rounded to the activation dtype, as torch's x + residual is
                x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
                tl.store(res_out_ptr + k, x, mask=k_ok & (pid == 0))
            xf = x.to(tl.float32)
            squares += xf * xf
            g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            if OFFSET:  # Gemma's norm scales by (1 + w)
                g = 1.0 + g
            xf = xf * g
        elif PROLOGUE == 2 or PROLOGUE == 3:  # SILU_MUL, GELU_MUL
            gate = x.to(tl.float32)
            up = tl.load(x_ptr + K + k, mask=k_ok, other=0.0).to(tl.float32)
            # the activation rounded to the activation dtype before the product, as torch's
            # act(gate) * up
            if PROLOGUE == 2:
                act = gate_activation(gate, 0)  # engine.layers.fused.GATE_ACTIVATIONS' SiLU
            else:
                act = gate_activation(gate, 1)  # and its tanh GELU
            act = act.to(x_ptr.dtype.element_ty).to(tl.float32)
            xf = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            xf = x.to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        return acc, squares

    @triton.jit
    def _row_gemv_kernel(
        x_ptr,
        res_ptr,
        g_ptr,
        w_ptr,
        ws_ptr,
        b_ptr,
        y_ptr,
        res_out_ptr,
        sq_in_ptr,
        sq_out_ptr,
        N,
        K,
        stride_wn,
        eps,
        n_sq_in,
        PROLOGUE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        OFFSET: tl.constexpr,
        EPILOGUE: tl.constexpr,
        SQ_IN: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program n: y[n * BLOCK_N : +BLOCK_N] = W[rows] @ prologue(x), fp32 multiply-adds into a
        [BLOCK_N, BLOCK_K] accumulator reduced once at the end. SILU_MUL, GELU_MUL: x holds
        [gate | up], each K long. OFFSET: NORM scales by (1 + w). The first weight tile is
        requested before the wait for the kernel before (no kernel writes the weights) and used by
        a first step outside the loop.

        EPILOGUE SILU_MUL / GELU_MUL: W is [gate; up], 2N rows, and y = act(gate) * up, N wide;
        the program's BLOCK_N rows alternate gate row i and up row N + i, so that its sums split
        into the pairs the activation takes.

        EPILOGUE NORM begins the next norm: s = y + residual goes to res_out, g * s (OFFSET:
        (1 + g) * s) to y, and the program's sum of s^2 to sq_out[pid]. PROLOGUE NORMED reads such
        a row as x and divides by sqrt(sum(sq_in[:n_sq_in]) / K + eps) at the end."""
        pid = tl.program_id(0)
        if EPILOGUE == 0 or EPILOGUE == 1:
            rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rn < N
            rows = rn
        else:
            local = tl.arange(0, BLOCK_N)
            rn = pid * (BLOCK_N // 2) + local // 2  # the gate row (and output) each row feeds
            row_ok = rn < N
            rows = rn + (local % 2) * N
        rk = tl.arange(0, BLOCK_K)
        rn_safe = tl.where(row_ok, rows, 0).to(tl.int64)  # out-of-range rows re-read row 0
        w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + rk[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(rk < K)[None, :], other=0.0)
        release(PDL)
        if PROLOGUE == 4:  # requested now, used after the loop
            sq_offs = tl.arange(0, SQ_IN)
            sq_in = tl.load(sq_in_ptr + sq_offs, mask=sq_offs < n_sq_in, other=0.0)
        acc, squares = _accumulate(
            acc, squares, w, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, K, pid,
            PROLOGUE, HAS_RESIDUAL, EVEN_K, OFFSET,
        )  # fmt: skip
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w_ptrs += BLOCK_K
            if EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=((k0 + rk) < K)[None, :], other=0.0)
            acc, squares = _accumulate(
                acc, squares, w, x_ptr, res_ptr, g_ptr, res_out_ptr, k0 + rk, K, pid,
                PROLOGUE, HAS_RESIDUAL, EVEN_K, OFFSET,
            )  # fmt: skip
        y = tl.sum(acc, axis=1)
        if PROLOGUE == 1:
            y = y / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
        elif PROLOGUE == 4:
            y = y / tl.sqrt(tl.sum(sq_in, axis=0) / K + eps)
        if HAS_SCALE:
            y = y * tl.load(ws_ptr + rn_safe)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rn_safe, mask=row_ok, other=0.0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty)  # the projection's output, rounded as torch's linear
        if EPILOGUE == 0:
            tl.store(y_ptr + rn, y, mask=row_ok)
        elif EPILOGUE == 1:
            # the norm's rows loaded only now: held across the loop, they cost registers enough
            # to halve the programs an SM holds at 8 warps
            g_rows = tl.load(g_ptr + rn_safe).to(tl.float32)
            if OFFSET:
                g_rows = 1.0 + g_rows
            res_rows = tl.load(res_ptr + rn_safe)
            summed, squares_out, scaled = begin_norm_rows(y, res_rows, g_rows, row_ok)
            tl.store(res_out_ptr + rn, summed, mask=row_ok)
            tl.store(sq_out_ptr + pid, squares_out)
            tl.store(y_ptr + rn, scaled, mask=row_ok)
        else:
            gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
            # act(gate) rounded to the activation dtype before the product, as torch's
            # act(gate) * up (engine.layers.fused's kernel)
            act = gate_activation(gate.to(tl.float32), EPILOGUE - 2)
            act = act.to(y_ptr.dtype.element_ty).to(tl.float32)
            out = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            gated = (act * up.to(tl.float32)).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + out, gated, mask=out < N)


def default_config(prologue: int, weight_dtype: torch.dtype, n: int, k: int) -> RowGemvConfig:
    """Tiles per shape and weight width: the fastest of bench/row_gemv.py's sweep at Llama-3.1-8B's
    shapes on an H100 (bench/results/2026-11-27-h100-row-gemv/row_gemv.json), and at
    Qwen3-30B-A3B's (--config qwen3-30b-a3b.json, bench/results/2026-11-27-h100-moe-batch1/), and
    Llama-3.1-70B's FP8 qkv on an H200 (bench/results/2026-11-28-h200-fp8-unit-scales/)."""
    name = str(weight_dtype).removeprefix("torch.")
    # the same loads, the same tiles
    prologue = {GELU_MUL: SILU_MUL, NORMED: PLAIN}.get(prologue, prologue)
    if (prologue, name, n, k) in TILE_OVERRIDES:
        return TILE_OVERRIDES[(prologue, name, n, k)]
    if weight_dtype.itemsize == 1 and prologue == PLAIN:
        # e4m3 without a prologue: the FP8 linears' one-row GEMV (engine.quant.fp8_kernels) and
        # FP8 gate_up closed by its activation (one_row_gated), bench/fp8_gemm.py's sweep
        if n >= 16384:  # gate_up
            return (16, 256, 4, 2)
        if n > k >= 8192:  # a wide model's qkv (Llama-3.1-70B's 10240 x 8192, H200 sweep)
            return (4, 1024, 4, 2)
        return (16, 512, 8, 3) if n >= 6144 else (8, 1024, 4, 2)  # qkv; o_proj, down
    if weight_dtype.itemsize == 1:  # e4m3 with a prologue (bench/row_gemv.py only)
        if n >= 16384:
            return (8, 1024, 4, 2)
        return (8, 512, 4, 2) if n >= 6144 else (8, 1024, 4, 3)
    if n <= 256:  # a router: the whole row in one step (Qwen3-30B-A3B's 128 x 2048)
        return (4, 2048, 4, 3)
    if n >= 16384:  # gate_up
        return (4, 512, 4, 3)
    if n >= 6144:  # qkv
        return (16, 512, 4, 3)
    if n >= 4096 and k <= 2048:  # a narrow model's qkv (Qwen3-30B-A3B's 5120 x 2048)
        return (8, 512, 4, 2)
    return (4, 512, 4, 2)  # down_proj


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    prologue: int = PLAIN,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    config: RowGemvConfig | None = None,
    offset: bool = False,
    epilogue: int = PLAIN,
    squares: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [1, K] (SILU_MUL, GELU_MUL: [1, 2K]) -> (y [1, N] in x's dtype, x + residual or None).

    weight [N, K] in x's dtype, or e4m3 with weight_scale [N] fp32; NORM: norm_weight [K], eps, an
    optional residual [1, K], and offset for Gemma's (1 + w); SILU_MUL, GELU_MUL: x is
    [gate | up]; NORMED: x is a NormedRow's scaled row and `squares` its sums of squares (eps the
    norm's). epilogue SILU_MUL, GELU_MUL: weight is [gate; up] and y = act(gate) * up,
    [1, N / 2] (epilogue NORM: row_gemv_norm_after). config overrides the tiles."""
    y, summed, _ = _launch(
        x, weight, weight_scale, bias, prologue, norm_weight, eps, residual, config, offset,
        epilogue, squares,
    )  # fmt: skip
    return y, summed


def row_gemv_norm_after(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    residual: torch.Tensor,
    offset: bool = False,
    config: RowGemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, K] -> s = W x + residual [1, N] and the next norm begun on it: (norm_weight * s (Gemma:
    (1 + w) * s) [1, N] in x's dtype, s, each program's sum of s^2 [programs] fp32)."""
    return _launch(
        x, weight, weight_scale, bias, PLAIN, norm_weight, 0.0, residual, config, offset, NORM,
        None,
    )  # fmt: skip


def _launch(
    x, weight, weight_scale, bias, prologue, norm_weight, eps, residual, config, offset, epilogue,
    squares,
):  # fmt: skip
    n, k = weight.shape
    x = x.contiguous()
    block_n, block_k, num_warps, num_stages = config or default_config(prologue, weight.dtype, n, k)
    block_k = min(block_k, max(32, triton.next_power_of_2(k)))
    if epilogue in (SILU_MUL, GELU_MUL):  # gate row i and up row n/2 + i alternate: pairs
        n, block_n = n // 2, max(2, block_n - block_n % 2)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    rows_per_program = block_n // 2 if epilogue in (SILU_MUL, GELU_MUL) else block_n
    grid = triton.cdiv(n, rows_per_program)
    summed = None
    if epilogue == NORM:
        summed = torch.empty_like(y)
    elif residual is not None:
        summed = torch.empty_like(x)
    squares_out = (
        torch.empty(grid, dtype=torch.float32, device=x.device) if epilogue == NORM else None
    )
    n_squares = squares.numel() if squares is not None else 0
    _row_gemv_kernel[(grid,)](
        x,
        residual.contiguous() if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        weight_scale if weight_scale is not None else x,
        bias if bias is not None else x,
        y,
        summed if summed is not None else y,
        squares if squares is not None else y,
        squares_out if squares_out is not None else y,
        n,
        k,
        weight.stride(0),
        eps,
        n_squares,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_SCALE=weight_scale is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        OFFSET=offset,
        EPILOGUE=epilogue,
        SQ_IN=max(16, triton.next_power_of_2(n_squares)),
        num_warps=num_warps,
        num_stages=num_stages,
        # engine.pdl: only without a prologue (the module docstring); with one, the kernel before
        # is often another GEMV, and launched early this one measured slower
        **launch_options(
            wanted=prologue == PLAIN or (prologue == NORMED and PDL_NORMED) or PDL_PROLOGUES
        ),
    )
    return y, summed, squares_out
