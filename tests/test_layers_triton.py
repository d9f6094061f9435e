"""Triton kernels (engine/layers/fused.py, skinny_gemm.py, vocab_argmax.py) against
transformers' and torch's layers (Llama's and Gemma 3's norms, activations and rotation).

GPU tests check the compiled kernels in bf16/fp16/fp32 on random shapes; one CPU test runs them
under Triton's interpreter in float32 so CI catches a broken kernel without a GPU.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from child_process import run_in_triton_interpreter
from engine.config import RopeConfig
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

REPO = Path(__file__).resolve().parent.parent
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=1e-3),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}


def hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(weight.shape[0], eps).to(device=x.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


def hf_rope(q: torch.Tensor, k: torch.Tensor, rot: RotaryEmbedding, positions: torch.Tensor):
    """transformers' rotation ([B, H, T, D] layout, cos/sin over the full head dim) on our cos/sin
    cache."""
    cos = torch.cat([rot.cos[positions]] * 2, dim=-1)[None]
    sin = torch.cat([rot.sin[positions]] * 2, dim=-1)[None]
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (7, 2048), (130, 896), (3, 96), (0, 64)])
def test_add_rms_norm_matches_transformers(dtype, rows, hidden):
    from engine.layers.fused import rms_norm_fused

    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + hidden)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
    res = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
    normed, new_res = rms_norm_fused(x, weight, 1e-5, res)
    assert torch.equal(new_res, x + res)  # the residual sum is rounded exactly as torch rounds it
    torch.testing.assert_close(normed, hf_norm(x + res, weight, 1e-5), **TOL[dtype])
    alone, none = rms_norm_fused(x, weight, 1e-6)
    assert none is None
    torch.testing.assert_close(alone, hf_norm(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 14336), (5, 8192), (33, 1000), (0, 128)])
def test_silu_and_mul_matches_torch(dtype, rows, inter):
    from engine.layers.fused import silu_and_mul_fused

    gen = torch.Generator(device="cuda").manual_seed(rows + inter)
    x = torch.randn(rows, 2 * inter, device="cuda", generator=gen).to(dtype)
    ref = F.silu(x[:, :inter]) * x[:, inter:]
    out = silu_and_mul_fused(x)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if dtype == torch.bfloat16 and rows:
        assert (
            out != ref
        ).float().mean() < 0.01  # rounded where torch rounds: almost every element is exact


def hf_gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(weight.shape[0], eps).to(device=x.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 5376), (7, 2560), (3, 96), (0, 64)])
def test_gemmas_offset_norm_matches_transformers(dtype, rows, hidden):
    from engine.layers.fused import rms_norm_fused

    gen = torch.Generator(device="cuda").manual_seed(rows * 5 + hidden)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
    res = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
    weight = (0.3 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
    normed, new_res = rms_norm_fused(x, weight, 1e-6, res, offset=True)
    assert torch.equal(new_res, x + res)
    torch.testing.assert_close(normed, hf_gemma_norm(x + res, weight, 1e-6), **TOL[dtype])
    alone, _ = rms_norm_fused(x, weight, 1e-6, offset=True)
    torch.testing.assert_close(alone, hf_gemma_norm(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("rows,inter", [(1, 21504), (5, 10240), (0, 128)])
def test_gelu_gate_matches_transformers(dtype, activation, rows, inter):
    from transformers.activations import ACT2FN

    from engine.layers.fused import gate_and_mul_fused

    gen = torch.Generator(device="cuda").manual_seed(rows + inter)
    x = (3 * torch.randn(rows, 2 * inter, device="cuda", generator=gen)).to(dtype)
    ref = ACT2FN[activation](x[:, :inter]) * x[:, inter:]
    torch.testing.assert_close(gate_and_mul_fused(x, activation), ref, **TOL[dtype])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_with_gemmas_qk_norm_matches_transformers(dtype):
    from engine.layers.fused import rope_fused

    gen = torch.Generator(device="cuda").manual_seed(3)
    rot = RotaryEmbedding(128, RopeConfig(theta=1000000.0), 4096, dtype, "cuda")
    q = torch.randn(9, 32, 128, device="cuda", generator=gen).to(dtype)
    k = torch.randn(9, 16, 128, device="cuda", generator=gen).to(dtype)
    wq = (0.3 * torch.randn(128, device="cuda", generator=gen)).to(dtype)
    wk = (0.3 * torch.randn(128, device="cuda", generator=gen)).to(dtype)
    pos = torch.randint(0, 4096, (9,), device="cuda", generator=gen)
    qo, ko = rope_fused(pos, q, k, rot.cos, rot.sin, wq, wk, 1e-6, norm_offset=True)
    qr, kr = hf_rope(hf_gemma_norm(q, wq, 1e-6), hf_gemma_norm(k, wk, 1e-6), rot, pos)
    torch.testing.assert_close(qo, qr, **TOL[dtype])
    torch.testing.assert_close(ko, kr, **TOL[dtype])


ROPES = [
    RopeConfig(theta=10000.0),
    RopeConfig(theta=500.0, rope_type="linear", factor=4.0),
    RopeConfig(
        theta=500000.0, rope_type="llama3", factor=32.0, original_max_position_embeddings=8192
    ),
]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(32, 8, 128), (14, 2, 64), (16, 8, 80), (4, 4, 256)]
)
def test_rope_matches_transformers(dtype, rope, heads, kv_heads, head_dim):
    from engine.layers.fused import rope_fused

    tokens = 19
    rot = RotaryEmbedding(head_dim, rope, 16384, dtype, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(heads * head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=gen).to(
        dtype
    )
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    # strided views, as the model has
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 16384, (tokens,), device="cuda", generator=gen)
    q_out, k_out = rope_fused(positions, q, k, rot.cos, rot.sin)
    q_ref, k_ref = hf_rope(q, k, rot, positions)
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])


@pytest.mark.gpu
@cuda
def test_rope_with_qwen3_qk_norm_matches_transformers():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from engine.layers.fused import rope_fused

    dtype, tokens, heads, kv_heads, head_dim = torch.bfloat16, 11, 16, 8, 128
    rot = RotaryEmbedding(head_dim, RopeConfig(theta=1000000.0), 4096, dtype, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(tokens, heads, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    norms = [Qwen3RMSNorm(head_dim, 1e-6).to("cuda", dtype) for _ in range(2)]
    for n in norms:
        n.weight.data.copy_(1 + 0.2 * torch.randn(head_dim, device="cuda", generator=gen))
    positions = torch.arange(100, 100 + tokens, device="cuda")
    q_out, k_out = rope_fused(
        positions, q, k, rot.cos, rot.sin, norms[0].weight, norms[1].weight, 1e-6
    )
    q_ref, k_ref = hf_rope(norms[0](q), norms[1](k), rot, positions)
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_into_paged_cache_matches_transformers(dtype, qk_norm):
    """Rotated k and raw v land at their slots (padding slot -1 writes nothing), q as transformers
    rotates it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from engine.attention import kv_cache_shape

    tokens, heads, kv_heads, head_dim, block_size = 9, 16, 4, 128, 16
    rot = RotaryEmbedding(head_dim, ROPES[2], 8192, dtype, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(17)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=gen).to(
        dtype
    )
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    cache = torch.full(
        kv_cache_shape(1, 12, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device="cuda"
    )[0]
    slots = torch.randperm(12 * block_size, device="cuda", generator=gen)[:tokens]
    slots[4] = -1
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=gen)
    norms, ours = [None, None], [None, None]
    if qk_norm:
        norms = [Qwen3RMSNorm(head_dim, 1e-6).to("cuda", dtype) for _ in range(2)]
        ours = [RMSNorm(head_dim, 1e-6, dtype, "cuda") for _ in range(2)]
        for n, o in zip(norms, ours):
            n.weight.data.copy_(1 + 0.2 * torch.randn(head_dim, device="cuda", generator=gen))
            o.weight.data.copy_(n.weight)
    assert rot.can_write_cache(q, cache)
    with torch.no_grad():
        q_out = rot.rotate_into_cache(positions, q, k, v, cache, slots, *ours)
        q_ref, k_ref = hf_rope(
            norms[0](q) if qk_norm else q, norms[1](k) if qk_norm else k, rot, positions
        )
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    flat = cache.reshape(2, -1, kv_heads, head_dim)
    real = torch.arange(tokens, device="cuda") != 4
    torch.testing.assert_close(flat[0, slots[real]], k_ref[real], **TOL[dtype])
    assert torch.equal(flat[1, slots[real]], v[real])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device="cuda")
    untouched[slots[real]] = False
    assert bool((flat[:, untouched] == 7.0).all())


SKINNY_SHAPES = [
    (1, 4096, 4096),
    (1, 6144, 4096),
    (3, 1000, 200),
    (8, 28672, 4096),
    (16, 4096, 14336),
    (5, 128256, 2048),
    (2, 96, 72),
]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", SKINNY_SHAPES)
def test_skinny_gemm_matches_torch_linear(dtype, m, n, k):
    """Plain, with bias, and into an fp32 buffer rounded as .float() is."""
    from engine.layers.skinny_gemm import skinny_applies, skinny_gemm

    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (0.05 * torch.randn(n, k, device="cuda", generator=gen)).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype)
    assert skinny_applies(x, w)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(skinny_gemm(x, w), F.linear(x, w), **tol)
    torch.testing.assert_close(skinny_gemm(x, w, b), F.linear(x, w, b), **tol)
    logits = torch.empty(m + 2, n, dtype=torch.float32, device="cuda")
    out = skinny_gemm(x, w, out=logits[:m])
    assert torch.equal(out, out.to(dtype).float())  # rounded to the activation dtype, then widened
    torch.testing.assert_close(out, F.linear(x, w).float(), **tol)


@pytest.mark.gpu
@cuda
def test_skinny_gemm_only_for_few_rows():
    from engine.layers.skinny_gemm import MAX_ROWS, skinny_applies

    w = torch.empty(64, 32, dtype=torch.bfloat16, device="cuda")
    assert skinny_applies(torch.empty(MAX_ROWS, 32, dtype=torch.bfloat16, device="cuda"), w)
    assert not skinny_applies(torch.empty(MAX_ROWS + 1, 32, dtype=torch.bfloat16, device="cuda"), w)
    assert not skinny_applies(torch.empty(1, 32, dtype=torch.float32, device="cuda"), w.float())
    assert not skinny_applies(torch.empty(1, 32, dtype=torch.bfloat16), w.cpu())


@pytest.mark.gpu
@cuda
def test_race_sample_follows_softmax_and_keys():
    from engine.layers.vocab_argmax import race_sample

    vocab, draws = 16, 40000
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = 1.5 * torch.randn(vocab, device="cuda", generator=gen)
    logits[3] = float("-inf")  # masked: never drawn
    keys = torch.randint(-(1 << 62), 1 << 62, (draws,), device="cuda", generator=gen)
    tokens = race_sample(logits.expand(draws, vocab).contiguous(), keys)
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    expected = logits.softmax(-1)
    assert freq[3] == 0
    allowed = expected > 0
    chi2 = (draws * (freq[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum().item()
    assert chi2 < 40, chi2  # df = 14; the 0.999 quantile is about 36
    # the same key gives the same token whatever the other rows hold
    big = torch.randn(5, 128256, device="cuda", generator=gen)
    k5 = torch.tensor([11, 22, 33, 44, 55], device="cuda")
    alone = race_sample(big[2:3], k5[2:3])
    assert race_sample(big, k5)[2] == alone[0]


@pytest.mark.gpu
@cuda
def test_greedy_argmax_picks_torch_argmax_ties_included():
    from engine.layers.vocab_argmax import greedy_argmax

    gen = torch.Generator(device="cuda").manual_seed(1)
    for rows, vocab in ((1, 128256), (64, 151936), (3, 262208), (5, 17)):
        # bf16-rounded logits tie often; the winner is the lowest column, as torch.argmax's
        logits = torch.randn(rows, vocab, device="cuda", generator=gen).bfloat16().float()
        logits[0, vocab // 3] = logits[0, -1] = logits[0].max() + 1
        assert torch.equal(greedy_argmax(logits), logits.argmax(-1)), (rows, vocab)
    masked = torch.full((2, 9000), float("-inf"), device="cuda")
    masked[1, 8999] = 0.0
    assert greedy_argmax(masked).tolist() == [0, 8999]


def test_the_engine_imports_without_triton():
    """A CPU install has no triton (the image's runtime, CPU torch's wheel): every module that
    holds Triton kernels imports there and leaves them out (an import of a kernel helper outside
    the module's `if triton` block stops the worker)."""
    import subprocess
    import sys

    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # import triton raises ImportError, as where it is absent
        import engine.layers.fused, engine.layers.row_gemv, engine.layers.vocab_argmax
        import engine.layers.fused_moe, engine.layers.fused_moe_decode, engine.layers.skinny_gemm
        import engine.quant.fp8_kernels, engine.norm_rounding, engine.pdl, engine.attention
        import engine.models.decoder, engine.sampling, engine.llm, handler.worker
        import engine.step_transfer, engine.step_inputs
        print("ok")
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (CPU torch has none)",
)
def test_vocab_argmax_under_the_triton_interpreter():
    """The split argmax on CPU: greedy equals torch.argmax (ties to the lowest column, a row of
    -inf, a vocabulary that is no multiple of the split); the random draw is the same whatever the
    split, and never a masked column."""
    script = textwrap.dedent("""
        import torch
        import engine.layers.vocab_argmax as va
        torch.manual_seed(0)
        logits = torch.randn(3, 10000).bfloat16().float()
        logits[0, 4097] = logits[0, 9999] = logits[0, 2] = 9.0
        logits[2] = float("-inf")
        for block in (1024, 4096, 16384):
            va.BLOCK = block
            assert torch.equal(va.greedy_argmax(logits), logits.argmax(-1)), block
        keys = torch.tensor([5, -7, 1 << 40])
        logits[2, 7777] = 0.0
        logits[1, :5000] = float("-inf")
        drawn = []
        for block in (1024, 16384):
            va.BLOCK = block
            drawn.append(va.race_sample(logits, keys))
        assert torch.equal(drawn[0], drawn[1]), drawn
        assert drawn[0][1] >= 5000 and drawn[0][2] == 7777, drawn
        print("ok")
    """)
    result = run_in_triton_interpreter(script)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (CPU torch has none)",
)
def test_kernels_under_the_triton_interpreter_match_torch_in_float32():
    """The kernels' logic on CPU (float32, where the interpreter rounds like torch): CI runs without
    a GPU."""
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from engine.config import RopeConfig
        from engine.layers.fused import rms_norm_fused, rope_fused, silu_and_mul_fused
        from engine.layers.norm import RMSNorm
        from engine.layers.rotary import RotaryEmbedding, apply_rotary
        torch.manual_seed(0)
        x, r = torch.randn(3, 96), torch.randn(3, 96)
        norm = RMSNorm(96, 1e-5, torch.float32)
        norm.weight.data.copy_(torch.randn(96))
        normed, res = rms_norm_fused(x, norm.weight, 1e-5, r)
        assert torch.equal(res, x + r)
        torch.testing.assert_close(normed, norm.reference(x + r))
        gu = torch.randn(4, 2 * 1500)
        torch.testing.assert_close(silu_and_mul_fused(gu), F.silu(gu[:, :1500]) * gu[:, 1500:])
        rot = RotaryEmbedding(80, RopeConfig(theta=10000.0), 64, torch.float32)
        qkv = torch.randn(5, (6 + 2 * 2) * 80)
        q, k = qkv[:, :480].view(5, 6, 80), qkv[:, 480:640].view(5, 2, 80)
        pos = torch.tensor([0, 7, 63, 1, 30])
        qo, ko = rope_fused(pos, q, k, rot.cos, rot.sin)
        torch.testing.assert_close(qo, apply_rotary(q, rot.cos[pos], rot.sin[pos]))
        torch.testing.assert_close(ko, apply_rotary(k, rot.cos[pos], rot.sin[pos]))
        qn, kn = RMSNorm(80, 1e-6, torch.float32), RMSNorm(80, 1e-6, torch.float32)
        qn.weight.data.copy_(torch.randn(80)); kn.weight.data.copy_(torch.randn(80))
        qo, ko = rope_fused(pos, q, k, rot.cos, rot.sin, qn.weight, kn.weight, 1e-6)
        torch.testing.assert_close(qo, apply_rotary(qn(q), rot.cos[pos], rot.sin[pos]))
        torch.testing.assert_close(ko, apply_rotary(kn(k), rot.cos[pos], rot.sin[pos]))
        v = qkv[:, 640:].view(5, 2, 80)
        cache = torch.full((2, 6, 4, 2, 80), 7.0)  # [K/V, blocks, block_size, kv heads, head_dim]
        slots = torch.tensor([3, 22, -1, 0, 9])
        qo = rot.rotate_into_cache(pos, q, k, v, cache, slots, qn, kn)
        torch.testing.assert_close(qo, apply_rotary(qn(q), rot.cos[pos], rot.sin[pos]))
        flat, real = cache.view(2, 24, 2, 80), slots >= 0
        rotated_k = apply_rotary(kn(k), rot.cos[pos], rot.sin[pos])
        torch.testing.assert_close(flat[0, slots[real]], rotated_k[real])
        assert torch.equal(flat[1, slots[real]], v[real]) and (flat[:, [1, 2, 23]] == 7.0).all()
        from engine.layers.skinny_gemm import skinny_gemm
        x, w, b = torch.randn(3, 200), torch.randn(33, 200), torch.randn(33)
        torch.testing.assert_close(skinny_gemm(x, w, b, config=(16, 64, 4, 2)), F.linear(x, w, b))
        out = torch.empty(5, 33, dtype=torch.float64)[1:4]
        torch.testing.assert_close(
            skinny_gemm(x, w, out=out, config=(32, 128, 4, 2)),
            F.linear(x, w).double(),
            atol=1e-4,
            rtol=1e-4,
        )
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (CPU torch has none)",
)
def test_gemmas_kernels_under_the_triton_interpreter_match_its_torch_layers_in_float32():
    """Gemma's (1 + w) norm (alone, after a residual, per head before the rotation and the cache
    write) and its GELU gates, in the fused kernels against the torch layers the CPU runs."""
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from engine.config import RopeConfig
        from engine.layers.activation import gate_and_mul
        from engine.layers.fused import gate_and_mul_fused, rms_norm_fused, rope_fused
        from engine.layers.norm import OffsetRMSNorm
        from engine.layers.rotary import RotaryEmbedding, apply_rotary
        torch.manual_seed(0)
        x, r = torch.randn(3, 96), torch.randn(3, 96)
        norm = OffsetRMSNorm(96, 1e-6, torch.float32)
        norm.weight.data.copy_(torch.randn(96))
        alone, none = rms_norm_fused(x, norm.weight, 1e-6, offset=True)
        torch.testing.assert_close(alone, norm.reference(x))
        normed, res = rms_norm_fused(x, norm.weight, 1e-6, r, offset=True)
        assert none is None and torch.equal(res, x + r)
        torch.testing.assert_close(normed, norm.reference(x + r))
        gu = 3 * torch.randn(4, 2 * 1500)
        for act in ("gelu_pytorch_tanh", "gelu", "silu"):
            torch.testing.assert_close(gate_and_mul_fused(gu, act), gate_and_mul(gu, act))
        rot = RotaryEmbedding(80, RopeConfig(theta=10000.0), 64, torch.float32)
        qkv = torch.randn(5, (6 + 2 * 2) * 80)
        q, k = qkv[:, :480].view(5, 6, 80), qkv[:, 480:640].view(5, 2, 80)
        v = qkv[:, 640:].view(5, 2, 80)
        pos = torch.tensor([0, 7, 63, 1, 30])
        qn, kn = OffsetRMSNorm(80, 1e-6, torch.float32), OffsetRMSNorm(80, 1e-6, torch.float32)
        qn.weight.data.copy_(torch.randn(80)); kn.weight.data.copy_(torch.randn(80))
        w = dict(q_norm_weight=qn.weight, k_norm_weight=kn.weight, eps=1e-6, norm_offset=True)
        qo, ko = rope_fused(pos, q, k, rot.cos, rot.sin, **w)
        torch.testing.assert_close(qo, apply_rotary(qn(q), rot.cos[pos], rot.sin[pos]))
        torch.testing.assert_close(ko, apply_rotary(kn(k), rot.cos[pos], rot.sin[pos]))
        cache = torch.full((2, 6, 4, 2, 80), 7.0)
        slots = torch.tensor([3, 22, -1, 0, 9])
        qo = rot.rotate_into_cache(pos, q, k, v, cache, slots, qn, kn)
        torch.testing.assert_close(qo, apply_rotary(qn(q), rot.cos[pos], rot.sin[pos]))
        flat, real = cache.view(2, 24, 2, 80), slots >= 0
        torch.testing.assert_close(
            flat[0, slots[real]], apply_rotary(kn(k), rot.cos[pos], rot.sin[pos])[real]
        )
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
