"""The norm and the gate activation writing their rows quantized for the FP8 linear after them
(engine.layers.fused: rms_norm_fp8, gate_and_mul_fp8; engine.layers.row_gemv: norm_linear and
act_linear hand them to Fp8Linear.forward_quantized). On CPU: the kernels under the Triton
interpreter against the torch norm or activation quantized per token by the reference quantizer,
and the layers' CPU path untouched; on a GPU (-m gpu): the same outputs bit for bit as the norm or
activation kernel followed by the per-token quantizer, and the layers' results equal to the unfused
ones at every row count that takes the path."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from child_process import run_in_triton_interpreter, run_with_triton_cache
from conftest import triton_nvidia_backend
from engine.layers import RMSNorm
from engine.layers.activation import gate_and_mul
from engine.layers.fused_linears import act_linear, norm_linear
from engine.quant.fp8 import Fp8Linear

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (CPU torch has none)",
)


@needs_triton
def test_quantizing_kernels_under_the_triton_interpreter():
    """Rows of widths that do not fill a block, with and without a residual, Llama's and Gemma's
    norms, SiLU and both GELUs over several column blocks: the scales equal the reference
    quantizer's, the values it would cast to e4m3 equal its (row / scale, clamped), the residual
    stream exactly. The kernels write into float32 here: the interpreter's own e4m3 cast drops the
    carry of a mantissa rounded up to the next power of two (-126.7 becomes -64), so the cast is
    left to the GPU test, which compares e4m3 bits."""
    script = textwrap.dedent("""
        import torch
        import triton
        from engine.layers import RMSNorm
        from engine.layers.activation import gate_and_mul
        from engine.layers.fused import (
            GATE_ACTIVATIONS, _gate_and_mul_fp8_kernel, _launch_rms_norm,
        )
        from engine.layers.norm import OffsetRMSNorm
        from engine.quant.fp8_kernels import quantize_rows_reference

        def check(q, scale, ref):
            _, ref_scale = quantize_rows_reference(ref)
            torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
            expected = (ref.float() / ref_scale).clamp(-448.0, 448.0)
            # within float32 rounding of the activation (torch and Triton compute it apart), far
            # below an e4m3 step (2^-9 at the smallest)
            torch.testing.assert_close(q, expected, rtol=1e-4, atol=1e-3)

        def empty(rows, cols):
            return torch.empty(rows, cols), torch.empty(rows, 1)

        torch.manual_seed(0)
        for rows, k in [(3, 40), (5, 64), (1, 100)]:
            x, res = torch.randn(rows, k), torch.randn(rows, k)
            for norm in (RMSNorm(k, 1e-5, torch.float32, "cpu"),
                         OffsetRMSNorm(k, 1e-6, torch.float32, "cpu")):
                norm.weight.data = torch.rand(k) + 0.5
                offset = isinstance(norm, OffsetRMSNorm)
                q, scale = empty(rows, k)
                summed = _launch_rms_norm(x, norm.weight, norm.eps, res, offset, q, scale)
                assert torch.equal(summed, x + res)
                check(q, scale, norm.reference(x + res))
                q, scale = empty(rows, k)
                assert _launch_rms_norm(x, norm.weight, norm.eps, None, offset, q, scale) is None
                check(q, scale, norm.reference(x))
        for rows, inter, block in [(3, 24, 32), (2, 5000, 4096)]:  # 5000: two column blocks
            gu = 3 * torch.randn(rows, 2 * inter)
            for act in ("silu", "gelu_pytorch_tanh", "gelu"):
                q, scale = empty(rows, inter)
                _gate_and_mul_fp8_kernel[(rows,)](
                    gu, q, scale, gu.stride(0), q.stride(0), inter,
                    ACT=GATE_ACTIVATIONS[act], BLOCK=block, PDL=False,
                )
                check(q, scale, gate_and_mul(gu, act))
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@needs_triton
def test_scaling_kernel_under_the_triton_interpreter():
    """The kernel after _scaled_mm's unit-scale product (fp8_kernels.scaled_mm_unit_scales):
    each row and column scaled by its own scale, the bias added, over column blocks that do not
    fill the last one: the fp32 product of the scales (written in fp32 here; the GPU test checks
    the bf16 output)."""
    script = textwrap.dedent("""
        import torch
        from engine.quant.fp8_kernels import _scale_product_kernel

        torch.manual_seed(0)
        for m, n, block, with_bias in [(3, 40, 16, True), (5, 64, 64, False), (1, 100, 32, True)]:
            acc = 1000 * torch.randn(m, n)
            xs, ws = torch.rand(m, 1) + 0.01, torch.rand(n) + 0.01
            bias = torch.randn(n).to(torch.bfloat16)
            y = torch.empty(m, n)  # fp32: the interpreter's bf16 cast truncates
            _scale_product_kernel[(m, (n + block - 1) // block)](
                acc, xs, ws, bias if with_bias else ws, y, n, acc.stride(0), y.stride(0),
                HAS_BIAS=with_bias, BLOCK_N=block, PDL=False,
            )
            want = acc * xs * ws + (bias.float() if with_bias else 0)
            torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.skipif(not triton_nvidia_backend(), reason="triton without its CUDA backend (ptxas)")
def test_quantizing_kernels_compile_for_hopper(tmp_path):
    """The norm writing e4m3 (with and without a residual, Gemma's norm), the gate activation's
    quantizing kernel, the per-token quantizer and the unit-scale product's scaling kernel,
    compiled ahead of time for sm_90 with bf16 activations: the e4m3 stores and the shared scale
    helpers through ptxas."""
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from engine.layers import fused
        from engine.quant import fp8_kernels

        def build(fn, sig, const, warps):
            sig = dict(sig, **{c: "constexpr" for c in const})
            source = ASTSource(fn=fn, signature=sig, constexprs=const)
            options = dict(num_warps=warps, num_stages=1, launch_pdl=True)
            triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)

        norm_sig = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp8e4nv",
                        res_out_ptr="*bf16", scale_ptr="*fp32", stride_x="i32", stride_res="i32",
                        stride_out="i32", stride_res_out="i32", n_cols="i32", eps="fp32")
        for residual, offset in ((True, False), (False, False), (True, True)):
            build(fused._rms_norm_kernel, norm_sig,
                  dict(HAS_RESIDUAL=residual, OFFSET=offset, QUANTIZE=True, BLOCK=4096, PDL=True),
                  16)
        gate_sig = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32", stride_x="i32",
                        stride_q="i32", n_cols="i32")
        for act in (0, 1):
            build(fused._gate_and_mul_fp8_kernel, gate_sig, dict(ACT=act, BLOCK=4096, PDL=True), 8)
        scale_sig = dict(acc_ptr="*fp32", xs_ptr="*fp32", ws_ptr="*fp32", b_ptr="*bf16",
                         y_ptr="*bf16", N="i32", stride_acc="i32", stride_y="i32")
        for bias in (True, False):
            build(fp8_kernels._scale_product_kernel, scale_sig,
                  dict(HAS_BIAS=bias, BLOCK_N=1024, PDL=True), 4)
        build(fp8_kernels._quantize_rows_kernel,
              dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", K="i32", stride_xm="i32",
                   stride_qm="i32"),
              dict(BLOCK_K=4096, PDL=True), 4)
        print("ok")
    """)
    done = run_with_triton_cache(script, tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_cpu_path_quantizes_in_the_linear():
    """On CPU the FP8 linear keeps quantizing its own input (the reference W8A8 numerics): the
    layers' results equal the norm or activation, then the linear."""
    torch.manual_seed(0)
    norm = RMSNorm(32, 1e-6, torch.float32, "cpu")
    norm.weight.data = torch.rand(32) + 0.5
    lin = Fp8Linear(32, 16, False, torch.float32, "cpu")
    lin.fill_random(0.1, torch.Generator().manual_seed(0))
    x, res = torch.randn(40, 32), torch.randn(40, 32)
    y, summed = norm_linear(norm, lin, x, res)
    assert torch.equal(summed, x + res)
    assert torch.equal(y, lin(norm.reference(x + res)))
    down = Fp8Linear(16, 8, False, torch.float32, "cpu")
    down.fill_random(0.1, torch.Generator().manual_seed(1))
    gu = torch.randn(40, 32)
    assert torch.equal(act_linear(down, gu, "silu"), down(gate_and_mul(gu, "silu")))


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [17, 64, 300])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.gpu
def test_quantized_norm_and_activation_equal_the_two_kernels(rows, offset):
    """Llama-3.1-8B's widths, bf16: e4m3 values and scales bit for bit those of the norm (or
    activation) kernel's output quantized by the per-token quantizer."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.layers.fused import (
        gate_and_mul_fp8,
        gate_and_mul_fused,
        rms_norm_fp8,
        rms_norm_fused,
    )
    from engine.quant.fp8_kernels import quantize_per_token

    torch.manual_seed(rows)
    dev, dt = "cuda", torch.bfloat16
    x, res = (torch.randn(rows, 4096, device=dev, dtype=dt) for _ in range(2))
    weight = (torch.rand(4096, device=dev) + 0.5).to(dt)
    normed, summed = rms_norm_fused(x, weight, 1e-5, res, offset)
    ref_q, ref_scale = quantize_per_token(normed)
    q, scale, q_summed = rms_norm_fp8(x, weight, 1e-5, res, offset)
    assert torch.equal(q_summed, summed)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    gu = 4 * torch.randn(rows, 2 * 14336, device=dev, dtype=dt)
    for act in ("silu", "gelu_pytorch_tanh"):
        ref_q, ref_scale = quantize_per_token(gate_and_mul_fused(gu, act))
        q, scale = gate_and_mul_fp8(gu, act)
        assert torch.equal(scale, ref_scale)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.gpu
def test_fp8_layers_with_quantized_input_equal_the_unfused_ones():
    """norm_linear and act_linear with Llama-3.1-8B's FP8 qkv, gate_up and down at the row counts
    that take the many-row path: the same results as with FUSE_QUANTIZE off, bit for bit; below
    that count (the skinny and one-row kernels) the path is not taken."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import engine.layers.fused_linears as fl

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    norm = RMSNorm(4096, 1e-5, dt, dev)
    norm.weight.data = (torch.rand(4096, device=dev) + 0.5).to(dt)
    qkv, down = Fp8Linear(4096, 6144, False, dt, dev), Fp8Linear(14336, 4096, False, dt, dev)
    for i, lin in enumerate((qkv, down)):
        lin.fill_random(0.02, torch.Generator(dev).manual_seed(i))
    assert not qkv.takes_quantized_rows(1, dt)  # one row: the GEMV, bf16 activations
    for rows in (2, 64, 1000):
        assert qkv.takes_quantized_rows(rows, dt)
        x, res = (torch.randn(rows, 4096, device=dev, dtype=dt) for _ in range(2))
        gu = torch.randn(rows, 2 * 14336, device=dev, dtype=dt)
        fused = norm_linear(norm, qkv, x, res), act_linear(down, gu, "silu")
        fl.FUSE_QUANTIZE = False
        try:
            plain = norm_linear(norm, qkv, x, res), act_linear(down, gu, "silu")
        finally:
            fl.FUSE_QUANTIZE = True
        assert torch.equal(fused[0][0], plain[0][0]) and torch.equal(fused[0][1], plain[0][1])
        assert torch.equal(fused[1], plain[1])
