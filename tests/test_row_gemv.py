"""engine.layers.row_gemv: batch-1 decode's linears with the norm (and residual add) or SiLU-and-mul
(Gemma: the (1 + w) norm, the tanh GELU) before them in one kernel. On CPU: the kernel under the
Triton interpreter against the unfused torch layers, its compile for sm_90, and the layers'
fallback; on a GPU (-m gpu): bf16 and FP8 weights at Llama-3.1-8B's shapes, bf16 at Gemma-3-27B's,
and a model's decode step with the kernel on and off."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from child_process import run_in_triton_interpreter, run_with_triton_cache
from conftest import triton_nvidia_backend
from engine.layers import Linear, RMSNorm
from engine.layers.activation import silu_and_mul_reference
from engine.layers.fused_linears import act_linear, norm_linear
from engine.layers.parallel import RowParallelLinear
from engine.quant.fp8 import Fp8Linear, RowParallelFp8Linear

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (CPU torch has none)",
)


@needs_triton
def test_row_gemv_under_the_triton_interpreter_matches_the_unfused_layers():
    """Each prologue, with and without residual, scale and bias, on shapes whose K and N are not
    multiples of the tiles (masks) and tiles that loop over K; float32 on CPU."""
    script = textwrap.dedent("""
        import torch
        import engine.layers.fused_linears as fl
        import engine.layers.row_gemv as rg
        from engine.layers import RMSNorm
        from engine.layers.activation import gate_and_mul, silu_and_mul_reference
        from engine.layers.norm import OffsetRMSNorm
        torch.manual_seed(0)
        for n, k, tiles in [(37, 40, (8, 16, 4, 1)), (64, 64, (16, 32, 4, 1)), (5, 24, None)]:
            w = torch.randn(n, k)
            scale, bias = torch.rand(n) + 0.5, torch.randn(n)
            x, res = torch.randn(1, k), torch.randn(1, k)
            norm = RMSNorm(k, 1e-5, torch.float32, "cpu")
            norm.weight.data = torch.rand(k) + 0.5
            for has_res in (True, False):
                y, summed = rg.row_gemv(x, w, scale, bias, rg.NORM, norm.weight, 1e-5,
                                        res if has_res else None, config=tiles)
                s = x + res if has_res else x
                ref = (norm.reference(s) @ w.t()) * scale + bias
                torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
                assert (summed is None) != has_res
                if has_res:
                    assert torch.equal(summed, s)
            gemma = OffsetRMSNorm(k, 1e-6, torch.float32, "cpu")
            gemma.weight.data = torch.randn(k) * 0.3
            y, summed = rg.row_gemv(x, w, scale, bias, rg.NORM, gemma.weight, 1e-6, res,
                                    config=tiles, offset=True)
            ref = (gemma.reference(x + res) @ w.t()) * scale + bias
            torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
            assert torch.equal(summed, x + res)
            gu = torch.randn(1, 2 * k)
            y, _ = rg.row_gemv(gu, w, None, None, rg.SILU_MUL, config=tiles)
            torch.testing.assert_close(y, silu_and_mul_reference(gu) @ w.t(), atol=1e-4, rtol=1e-4)
            y, _ = rg.row_gemv(gu, w, None, None, rg.GELU_MUL, config=tiles)
            gelu = gate_and_mul(gu, "gelu_pytorch_tanh")
            torch.testing.assert_close(y, gelu @ w.t(), atol=1e-4, rtol=1e-4)
            y, _ = rg.row_gemv(x, w, scale, None, rg.PLAIN, config=tiles)
            torch.testing.assert_close(y, (x @ w.t()) * scale, atol=1e-4, rtol=1e-4)
        # the layers' path (one_row_operands, norm_linear, act_linear), with the CUDA check
        # answered yes on CPU: the kernel's results against the layers one after the other
        from engine.layers import Linear
        fl.row_gemv_applies = lambda x: True
        lin = Linear(40, 24, True, torch.float32, "cpu")
        lin.weight.data.normal_()
        lin.bias.data.normal_()
        norm = RMSNorm(40, 1e-5, torch.float32, "cpu")
        norm.weight.data = torch.rand(40) + 0.5
        x, res = torch.randn(1, 40), torch.randn(1, 40)
        y, summed = fl.norm_linear(norm, lin, x, res)
        assert torch.equal(summed, x + res)
        torch.testing.assert_close(y, lin(norm.reference(x + res)), atol=1e-4, rtol=1e-4)
        y, same = fl.norm_linear(norm, lin, x, None)
        assert same is x
        torch.testing.assert_close(y, lin(norm.reference(x)), atol=1e-4, rtol=1e-4)
        down, gu = Linear(20, 24, False, torch.float32, "cpu"), torch.randn(1, 40)
        down.weight.data.normal_()
        torch.testing.assert_close(
            fl.act_linear(down, gu, "silu"), down(silu_and_mul_reference(gu)), atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(
            fl.act_linear(down, gu, "gelu_pytorch_tanh"),
            down(gate_and_mul(gu, "gelu_pytorch_tanh")),
            atol=1e-4,
            rtol=1e-4,
        )
        gemma = OffsetRMSNorm(40, 1e-6, torch.float32, "cpu")
        gemma.weight.data = torch.randn(40) * 0.3
        y, summed = fl.norm_linear(gemma, lin, x, res)
        assert torch.equal(summed, x + res)
        torch.testing.assert_close(y, lin(gemma.reference(x + res)), atol=1e-4, rtol=1e-4)
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@needs_triton
def test_gated_epilogue_under_the_triton_interpreter_matches_gate_and_mul():
    """gate_up's kernel closed by act(gate) * up (SiLU, tanh GELU): after the norm prologue or none,
    with per-row scales and a bias, gate/up row counts that do not fill the last program, an odd
    BLOCK_N (made even); then the MLP's path (one_row_gated through MLP.norm_forward) against the
    layers one after the other: the norm in the kernel for weights of the row's width, the norm's
    own kernel for narrower scaled weights (FP8's case; fp16 here); float32 on CPU."""
    script = textwrap.dedent("""
        from types import SimpleNamespace
        import torch
        import engine.layers.fused_linears as fl
        import engine.layers.row_gemv as rg
        from engine.layers import RMSNorm
        from engine.layers.activation import gate_and_mul
        from engine.layers.norm import OffsetRMSNorm
        from engine.models.decoder import MLP
        torch.manual_seed(0)
        for rows, k, tiles in [(74, 40, (8, 16, 4, 1)), (38, 24, (5, 32, 4, 1)), (10, 24, None)]:
            w = torch.randn(rows, k)
            scale, bias = torch.rand(rows) + 0.5, torch.randn(rows)
            x, res = torch.randn(1, k), torch.randn(1, k)
            norm = RMSNorm(k, 1e-5, torch.float32, "cpu")
            norm.weight.data = torch.rand(k) + 0.5
            for act, code in (("silu", rg.SILU_MUL), ("gelu_pytorch_tanh", rg.GELU_MUL)):
                y, summed = rg.row_gemv(x, w, scale, bias, rg.NORM, norm.weight, 1e-5, res,
                                        config=tiles, epilogue=code)
                ref = gate_and_mul((norm.reference(x + res) @ w.t()) * scale + bias, act)
                assert y.shape == (1, rows // 2)
                torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
                assert torch.equal(summed, x + res)
                y, _ = rg.row_gemv(x, w, scale, None, rg.PLAIN, config=tiles, epilogue=code)
                ref = gate_and_mul((x @ w.t()) * scale, act)
                torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)

        from scaled_linear import ScaledHalf

        fl.row_gemv_applies = lambda x: True  # the CUDA check answered yes on CPU
        for act in ("silu", "gelu_pytorch_tanh"):
            cfg = SimpleNamespace(hidden_size=40, intermediate_size=36, hidden_act=act)
            mlp = MLP(cfg, torch.float32, "cpu")
            mlp.gate_up_proj.weight.data.normal_()
            mlp.down_proj.weight.data.normal_()
            x, res = torch.randn(1, 40), torch.randn(1, 40)
            for norm in (RMSNorm(40, 1e-5, torch.float32, "cpu"),
                         OffsetRMSNorm(40, 1e-6, torch.float32, "cpu")):
                norm.weight.data = torch.rand(40) + 0.5
                fl.GATED = False
                plain, plain_res = mlp.norm_forward(norm, x, res)
                fl.GATED = True
                assert fl.one_row_gated(norm, mlp.gate_up_proj, x, res, act) is not None
                y, summed = mlp.norm_forward(norm, x, res)
                assert torch.equal(summed, plain_res) and torch.equal(summed, x + res)
                torch.testing.assert_close(y, plain, atol=1e-4, rtol=1e-4)
                ref = mlp.down_proj(gate_and_mul(mlp.gate_up_proj(norm.reference(x + res)), act))
                torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
            narrow = ScaledHalf(torch.randn(72, 40), torch.rand(72) + 0.5)
            y, summed = fl.one_row_gated(norm, narrow, x, res, act)
            assert torch.equal(summed, x + res)
            ref = gate_and_mul(narrow(norm.reference(x + res)), act)
            torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-3)
            y, same = fl.one_row_gated(norm, narrow, x, None, act)
            assert same is x
            torch.testing.assert_close(y, gate_and_mul(narrow(norm.reference(x)), act),
                                       atol=1e-3, rtol=1e-3)
        # what it does not take: another activation, GATED off
        assert fl.one_row_gated(norm, mlp.gate_up_proj, x, res, "relu") is None
        fl.GATED = False
        assert fl.one_row_gated(norm, mlp.gate_up_proj, x, res, "silu") is None
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@needs_triton
def test_norm_begun_by_the_linear_before_under_the_triton_interpreter():
    """The norm split over two kernels (row_gemv.linear_add_norm): the linear before it writes
    s = W x + residual, w * s and its programs' sums of s^2 (Llama's norm and Gemma's, scales and a
    bias, rows that do not fill the last program); the linear after divides by the rms (plain and
    closed by the gate activation); then a dense MLP between two of them (o_proj's output in, the
    next layer's norm begun by down) against the layers one after the other, with weights of the
    row's width and narrower scaled ones (FP8's case; fp16 here); float32 on CPU."""
    script = textwrap.dedent("""
        from types import SimpleNamespace
        import torch
        import engine.layers.fused_linears as fl
        import engine.layers.row_gemv as rg
        from engine.layers import Linear, RMSNorm
        from engine.layers.activation import gate_and_mul
        from engine.layers.norm import OffsetRMSNorm
        from engine.models.decoder import MLP
        torch.manual_seed(0)
        for n, k, tiles in [(37, 40, (8, 16, 4, 1)), (64, 24, (16, 32, 4, 1)), (40, 24, None)]:
            w, w2 = torch.randn(n, k), torch.randn(2 * 6, n)
            scale, bias = torch.rand(n) + 0.5, torch.randn(n)
            x, res = torch.randn(1, k), torch.randn(1, n)
            for norm in (RMSNorm(n, 1e-5, torch.float32, "cpu"),
                         OffsetRMSNorm(n, 1e-6, torch.float32, "cpu")):
                norm.weight.data = torch.rand(n) + 0.5
                offset = isinstance(norm, OffsetRMSNorm)
                scaled, summed, squares = rg.row_gemv_norm_after(
                    x, w, scale, bias, norm.weight, res, offset, config=tiles)
                s = (x @ w.t()) * scale + bias + res
                torch.testing.assert_close(summed, s, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(squares.sum(), summed.square().sum())
                row = fl.NormedRow(scaled, squares, summed, norm)
                torch.testing.assert_close(row.finish(), norm.reference(summed))
                y, _ = rg.row_gemv(scaled, w2, None, None, rg.NORMED, eps=norm.eps,
                                   squares=squares)
                torch.testing.assert_close(y, norm.reference(summed) @ w2.t(), atol=1e-4,
                                           rtol=1e-4)
                y, _ = rg.row_gemv(scaled, w2, None, None, rg.NORMED, eps=norm.eps,
                                   squares=squares, epilogue=rg.SILU_MUL)
                ref = gate_and_mul(norm.reference(summed) @ w2.t(), "silu")
                torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)

        from scaled_linear import ScaledHalf

        fl.row_gemv_applies = lambda x: True  # the CUDA check answered yes on CPU
        cfg = SimpleNamespace(hidden_size=40, intermediate_size=36, hidden_act="silu")
        mlp = MLP(cfg, torch.float32, "cpu")
        mlp.gate_up_proj.weight.data.normal_()
        mlp.down_proj.weight.data.normal_()
        o_proj, qkv = Linear(24, 40, False, torch.float32, "cpu"), Linear(40, 56, True,
                                                                           torch.float32, "cpu")
        for p in (*o_proj.parameters(), *qkv.parameters()):
            p.data.normal_()
        norms = [RMSNorm(40, 1e-5, torch.float32, "cpu") for _ in range(2)]
        for norm in norms:
            norm.weight.data = torch.rand(40) + 0.5
        heads, res = torch.randn(1, 24), torch.randn(1, 40)
        # the layers one after the other
        s1 = o_proj(heads) + res
        s2 = mlp(norms[0].reference(s1)) + s1
        ref_y = qkv(norms[1].reference(s2))
        narrow = ScaledHalf(mlp.down_proj.weight.data, torch.ones(40))
        for down in (mlp.down_proj, narrow):
            mlp.down_proj = down
            h, none = fl.linear_add_norm(o_proj, heads, res, norms[0])
            assert isinstance(h, fl.NormedRow) and none is None
            out, none = mlp.norm_forward(norms[0], h, None, norms[1])
            assert isinstance(out, fl.NormedRow) and none is None
            want = s2 if down is not narrow else mlp(norms[0].reference(s1)) + s1
            torch.testing.assert_close(out.summed, want, atol=1e-3, rtol=1e-3)
            y, summed = fl.norm_linear(norms[1], qkv, out, None)
            assert summed is out.summed
            torch.testing.assert_close(y, qkv(norms[1].reference(want)), atol=1e-3, rtol=1e-3)
        # a reader with no kernel for it finishes the norm first
        y, _ = fl.norm_linear(norms[1], lambda h: h * 2, out, None)
        torch.testing.assert_close(y, 2 * norms[1].reference(out.summed))
        # switched off, or no residual: the plain pair
        fl.NORM_AFTER = False
        y, r = fl.linear_add_norm(o_proj, heads, res, norms[0])
        assert r is res and not isinstance(y, fl.NormedRow)
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.skipif(not triton_nvidia_backend(), reason="triton without its CUDA backend (ptxas)")
def test_row_gemv_compiles_for_hopper(tmp_path):
    """The kernel with bf16 and e4m3 weights, every prologue, the default tiles of each
    Llama-3.1-8B shape (and Gemma 3's norm and GELU), compiled ahead of time for sm_90: types across
    the branches, registers and shared memory, ptxas."""
    script = textwrap.dedent("""
        import torch
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import engine.layers.fused_linears as fl
        import engine.layers.row_gemv as rg

        def build(w_type, prologue, residual, n, k, offset=False, epilogue=rg.PLAIN):
            w_dtype = torch.float8_e4m3fn if w_type == "fp8e4nv" else torch.bfloat16
            bn, bk, warps, stages = rg.default_config(prologue, w_dtype, n, k)
            ptrs = ["x_ptr", "res_ptr", "g_ptr", "w_ptr", "ws_ptr", "b_ptr", "y_ptr", "res_out_ptr",
                    "sq_in_ptr", "sq_out_ptr"]
            sig = {p: "*bf16" for p in ptrs}
            sig.update(w_ptr="*" + w_type, ws_ptr="*fp32", N="i32", K="i32", stride_wn="i32",
                       eps="fp32", sq_in_ptr="*fp32", sq_out_ptr="*fp32", n_sq_in="i32")
            const = dict(PROLOGUE=prologue, HAS_RESIDUAL=residual, HAS_SCALE=w_type != "bf16",
                         HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, OFFSET=offset,
                         EPILOGUE=epilogue, SQ_IN=512, PDL=True)
            sig.update({c: "constexpr" for c in const})
            source = ASTSource(fn=rg._row_gemv_kernel, signature=sig, constexprs=const)
            options = dict(num_warps=warps, num_stages=stages, launch_pdl=True)
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
            # the first weight tile is requested before the wait for the kernel before it, and
            # the input row only after it (engine.pdl's contract)
            ptx = kernel.asm["ptx"]
            wait = ptx.index("griddepcontrol.wait")
            assert "ld.global" in ptx[:wait], "no weight load before the wait"
            assert "griddepcontrol.launch_dependents" in ptx[wait:]

        for w_type in ("bf16", "fp8e4nv"):
            build(w_type, rg.NORM, True, 6144, 4096)
            build(w_type, rg.NORM, False, 28672, 4096)
            build(w_type, rg.SILU_MUL, False, 4096, 14336)
            # gate_up closed by SiLU-and-mul: after the norm (bf16) or none (FP8)
            build(w_type, rg.NORM if w_type == "bf16" else rg.PLAIN, False, 28672, 4096,
                  epilogue=rg.SILU_MUL)
            build(w_type, rg.PLAIN, False, 4096, 14336)  # down after it
            # o_proj and down beginning the norm after them; qkv and gate_up finishing it
            build(w_type, rg.PLAIN, True, 4096, 4096, epilogue=rg.NORM)
            build(w_type, rg.PLAIN, True, 4096, 14336, epilogue=rg.NORM)
            build(w_type, rg.NORMED, False, 6144, 4096)
            build(w_type, rg.NORMED, False, 28672, 4096, epilogue=rg.SILU_MUL)
        # Gemma 3 27B: its (1 + w) norm before qkv and gate_up, its tanh GELU before down
        build("bf16", rg.NORM, True, 8192, 5376, offset=True)
        build("bf16", rg.GELU_MUL, False, 5376, 21504)
        build("bf16", rg.NORM, True, 43008, 5376, offset=True, epilogue=rg.GELU_MUL)
        print("ok")
    """)
    done = run_with_triton_cache(script, tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.skipif(not triton_nvidia_backend(), reason="triton without its CUDA backend (ptxas)")
def test_beginning_the_norm_after_costs_no_occupancy(tmp_path):
    """o_proj and down begin the next norm in their epilogue (row_gemv_norm_after). Compiled for
    sm_90 at Llama-3.1-8B's and -70B's default tiles, that kernel fits as many programs on an SM
    (by ptxas's register count) as the same GEMV without it: the norm's rows held across the loop
    over K once cost the 70B's FP8 kernel half its programs and 25 us a call on down."""
    script = textwrap.dedent("""
        import subprocess
        import torch
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import ASTSource
        import engine.layers.row_gemv as rg

        def programs_per_sm(w_type, epilogue, n, k, tmp):
            w_dtype = torch.float8_e4m3fn if w_type == "fp8e4nv" else torch.bfloat16
            bn, bk, warps, stages = rg.default_config(rg.PLAIN, w_dtype, n, k)
            ptrs = ["x_ptr", "res_ptr", "g_ptr", "w_ptr", "ws_ptr", "b_ptr", "y_ptr", "res_out_ptr",
                    "sq_in_ptr", "sq_out_ptr"]
            sig = {p: "*bf16" for p in ptrs}
            sig.update(w_ptr="*" + w_type, ws_ptr="*fp32", N="i32", K="i32", stride_wn="i32",
                       eps="fp32", sq_in_ptr="*fp32", sq_out_ptr="*fp32", n_sq_in="i32")
            const = dict(PROLOGUE=rg.PLAIN, HAS_RESIDUAL=epilogue == rg.NORM,
                         HAS_SCALE=w_type != "bf16", HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk,
                         EVEN_K=True, OFFSET=False, EPILOGUE=epilogue, SQ_IN=16, PDL=True)
            sig.update({c: "constexpr" for c in const})
            source = ASTSource(fn=rg._row_gemv_kernel, signature=sig, constexprs=const)
            options = dict(num_warps=warps, num_stages=stages, launch_pdl=True)
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            with open(tmp + "/k.ptx", "w") as f:
                f.write(kernel.asm["ptx"])
            done = subprocess.run([get_ptxas(90).path, "-v", "-arch=sm_90a", tmp + "/k.ptx", "-o",
                                   tmp + "/k.cubin"], capture_output=True, text=True, check=True)
            regs = int(done.stderr.split("Used ")[1].split(" registers")[0])
            return min(65536 // (-(-regs // 8) * 8 * 32 * warps), 64 // warps), regs

        for w_type in ("bf16", "fp8e4nv"):
            for n, k in ((4096, 4096), (4096, 14336), (8192, 8192), (8192, 28672)):
                plain = programs_per_sm(w_type, rg.PLAIN, n, k, TMP)
                norm_after = programs_per_sm(w_type, rg.NORM, n, k, TMP)
                assert norm_after[0] >= plain[0], (w_type, n, k, plain, norm_after)
        print("ok")
    """).replace("TMP", repr(str(tmp_path)))
    done = run_with_triton_cache(script, tmp_path / "cache")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_layers_fall_back_where_the_kernel_does_not_serve():
    """On CPU (or several rows, or a row-parallel linear) the same results come from the layers one
    after the other, with the residual stream returned as the norm returns it."""
    torch.manual_seed(0)
    norm, lin = RMSNorm(32, 1e-6, torch.float32, "cpu"), Linear(32, 8, True, torch.float32, "cpu")
    for p in (*norm.parameters(), *lin.parameters()):
        p.data.normal_()
    x, res = torch.randn(3, 32), torch.randn(3, 32)
    y, summed = norm_linear(norm, lin, x, res)
    assert torch.equal(summed, x + res)
    torch.testing.assert_close(y, lin(norm.reference(x + res)))
    y, same = norm_linear(norm, lin, x, None)
    assert same is x
    torch.testing.assert_close(y, lin(norm.reference(x)))
    down = Linear(16, 8, False, torch.float32, "cpu")
    down.weight.data.normal_()
    gu = torch.randn(1, 32)
    torch.testing.assert_close(act_linear(down, gu, "silu"), down(silu_and_mul_reference(gu)))
    # row-parallel linears all-reduce after their product: never the one-row kernel's; FP8 linears
    # hand over their per-row scales with the weight
    assert RowParallelLinear(16, 8, False, torch.float32, "cpu", None).one_row_operands() is None
    assert RowParallelFp8Linear(16, 8, False, torch.float32, "cpu", None).one_row_operands() is None
    fp8 = Fp8Linear(16, 8, False, torch.float32, "cpu")
    weight, scale, bias = fp8.one_row_operands()
    assert weight is fp8.weight and scale is fp8.weight_scale and bias is None


# ---- GPU ---------------------------------------------------------------------------------------
def _unfused(fn, *args):
    """fn(*args) with the one-row kernel off: the layers one after the other."""
    import engine.layers.fused_linears as fl

    fl.FUSE = False
    try:
        return fn(*args)
    finally:
        fl.FUSE = True


def _assert_within_bf16(fused: torch.Tensor, plain: torch.Tensor, what) -> None:
    err = (fused.float() - plain.float()).abs().max().item()
    scale = plain.float().abs().max().item()
    assert err <= 2e-2 * scale, (what, err, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_row_gemv_matches_the_unfused_layers_at_llama_shapes(fp8):
    """qkv and gate_up after the residual add and norm, down after SiLU-and-mul, bf16 activations:
    within bf16 rounding of the layers one after the other (which round the normed input once
    more); the residual stream bit for bit. bf16 weights through the layers' path (norm_linear,
    act_linear); FP8 weights, which the layers keep unfused, through the kernel as
    bench/row_gemv.py calls it."""
    import engine.layers.row_gemv as rg

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    make = Fp8Linear if fp8 else Linear
    hidden, inter = 4096, 14336
    norm = RMSNorm(hidden, 1e-5, dt, dev)
    norm.weight.data = (torch.rand(hidden, device=dev) + 0.5).to(dt)
    for n, k, act in [(6144, hidden, False), (2 * inter, hidden, False), (hidden, inter, True)]:
        lin = make(k, n, False, dt, dev)
        if fp8:
            lin.fill_random(0.02, torch.Generator(dev).manual_seed(n))
        else:
            lin.weight.data.normal_(0.0, 0.02)
        if act:
            gu = torch.randn(1, 2 * k, device=dev, dtype=dt)
            if fp8:
                fused = rg.row_gemv(gu, lin.weight, lin.weight_scale, None, rg.SILU_MUL)[0]
            else:
                fused = act_linear(lin, gu, "silu")
            plain = _unfused(act_linear, lin, gu, "silu")
        else:
            x, res = (torch.randn(1, k, device=dev, dtype=dt) for _ in range(2))
            if fp8:
                fused, summed = rg.row_gemv(
                    x, lin.weight, lin.weight_scale, None, rg.NORM, norm.weight, norm.eps, res
                )
            else:
                fused, summed = norm_linear(norm, lin, x, res)
            plain, ref_summed = _unfused(norm_linear, norm, lin, x, res)
            assert torch.equal(summed, ref_summed)
        _assert_within_bf16(fused, plain, (n, k))


@pytest.mark.gpu
def test_row_gemv_matches_the_unfused_layers_at_gemma_shapes():
    """Gemma-3-27B's qkv and gate_up after its (1 + w) norm (the residual added first), and down
    after the tanh GELU, through the layers' path, bf16: within bf16 rounding of the layers one
    after the other; the residual stream bit for bit."""
    from engine.layers.norm import OffsetRMSNorm

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    hidden, inter = 5376, 21504
    norm = OffsetRMSNorm(hidden, 1e-6, dt, dev)
    norm.weight.data = (0.3 * torch.randn(hidden, device=dev)).to(dt)
    for n, k, act in [(8192, hidden, False), (2 * inter, hidden, False), (hidden, inter, True)]:
        lin = Linear(k, n, False, dt, dev)
        lin.weight.data.normal_(0.0, 0.02)
        if act:
            gu = torch.randn(1, 2 * k, device=dev, dtype=dt)
            fused = act_linear(lin, gu, "gelu_pytorch_tanh")
            plain = _unfused(act_linear, lin, gu, "gelu_pytorch_tanh")
        else:
            x, res = (torch.randn(1, k, device=dev, dtype=dt) for _ in range(2))
            fused, summed = norm_linear(norm, lin, x, res)
            plain, ref_summed = _unfused(norm_linear, norm, lin, x, res)
            assert torch.equal(summed, ref_summed)
        _assert_within_bf16(fused, plain, (n, k))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fp8,act,hidden,inter",
    [
        (False, "silu", 4096, 14336),
        (True, "silu", 4096, 14336),
        (False, "gelu_pytorch_tanh", 5376, 21504),
    ],
)
def test_gated_mlp_matches_the_unfused_layers(fp8, act, hidden, inter):
    """The MLP at one row with the activation closing gate_up's kernel (row_gemv.one_row_gated:
    bf16 weights with the norm inside, FP8 after the norm's kernel) against the layers one after
    the other, at Llama-3.1-8B's and Gemma-3-27B's shapes: within bf16 rounding, the residual
    stream bit for bit."""
    from types import SimpleNamespace

    import engine.layers.fused_linears as fl
    from engine.models.decoder import MLP

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, hidden_act=act)
    make = Fp8Linear if fp8 else Linear
    mlp = MLP(cfg, dt, dev, make, make)
    for i, lin in enumerate((mlp.gate_up_proj, mlp.down_proj)):
        if fp8:
            lin.fill_random(0.02, torch.Generator(dev).manual_seed(i))
        else:
            lin.weight.data.normal_(0.0, 0.02)
    norm = RMSNorm(hidden, 1e-5, dt, dev)
    norm.weight.data = (torch.rand(hidden, device=dev) + 0.5).to(dt)
    x, res = (torch.randn(1, hidden, device=dev, dtype=dt) for _ in range(2))
    assert fl.one_row_gated(norm, mlp.gate_up_proj, x, res, act) is not None
    gated, summed = mlp.norm_forward(norm, x, res)
    plain, ref_summed = _unfused(mlp.norm_forward, norm, x, res)
    assert torch.equal(summed, ref_summed)
    _assert_within_bf16(gated, plain, (fp8, act))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("hidden, inter, qkv_rows", [(4096, 14336, 6144), (8192, 28672, 10240)])
def test_norm_begun_by_the_linear_before_matches_the_unfused_layers(fp8, hidden, inter, qkv_rows):
    """At Llama-3.1-8B's and -70B's shapes (their default tiles), bf16 or FP8 weights: o_proj begins
    the MLP's norm, the MLP's down the next layer's (row_gemv.linear_add_norm), and qkv finishes it;
    against the layers one after the other within bf16 rounding, the residual stream within one
    rounding of its sums."""
    from types import SimpleNamespace

    import engine.layers.fused_linears as fl
    from engine.models.decoder import MLP

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
    make = Fp8Linear if fp8 else Linear
    mlp = MLP(cfg, dt, dev, make, make)
    o_proj, qkv = make(hidden, hidden, False, dt, dev), make(hidden, qkv_rows, False, dt, dev)
    for i, lin in enumerate((mlp.gate_up_proj, mlp.down_proj, o_proj, qkv)):
        if fp8:
            lin.fill_random(0.02, torch.Generator(dev).manual_seed(i))
        else:
            lin.weight.data.normal_(0.0, 0.02)
    norms = [RMSNorm(hidden, 1e-5, dt, dev) for _ in range(2)]
    for norm in norms:
        norm.weight.data = (torch.rand(hidden, device=dev) + 0.5).to(dt)
    heads, res = (torch.randn(1, hidden, device=dev, dtype=dt) for _ in range(2))

    def chain():
        h, r = fl.linear_add_norm(o_proj, heads, res, norms[0])
        out, r = mlp.norm_forward(norms[0], h, r, norms[1])
        return norm_linear(norms[1], qkv, out, r)

    h, _ = fl.linear_add_norm(o_proj, heads, res, norms[0])
    assert isinstance(h, fl.NormedRow)
    y, summed = chain()
    plain, ref_summed = _unfused(chain)
    _assert_within_bf16(summed, ref_summed, "residual")
    _assert_within_bf16(y, plain, fp8)
