"""FP8 W8A8 (EngineArgs.quantization "fp8") on CPU: the reference numerics against torch's fp32
matmul, the models of several families with FP8 linears against their fp32 selves, the pack round
trip (and a bf16 pack never taken for fp8), dummy weights, tensor parallelism over gloo, the
settings and refusals (other schemes, FP8 MoE checkpoints, GPUs without FP8 tensor cores); MoE
models with FP8 experts."""

from __future__ import annotations

import os

import pytest
import torch

from cache.loader import PackError, read_pack
from engine import LLM, EngineArgs, SamplingParams
from engine.config import ModelConfig
from engine.models.weights import load_model, load_model_from_pack, pack_path
from engine.quant import check_quantization, fp8_kernels as fk, quant_config
from engine.quant.fp8 import Fp8Linear, fp8_device_error
from test_model_parity import prefill_then_decode
from tiny_models import make_tiny_model

QUANT_NOISE = 0.08  # W8A8 against the unquantized product (e4m3 keeps 3 mantissa bits)


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 96, 160), (33, 64, 512), (128, 256, 96)])
def test_reference_linear_is_the_fp32_product_of_the_quantized_operands(m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen) * 2
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    wq, ws = fk.quantize_rows_reference(w)
    assert wq.dtype == torch.float8_e4m3fn and ws.shape == (n, 1)
    # each row's largest magnitude lands on e4m3's largest finite value
    assert torch.equal(wq.float().abs().amax(dim=1), torch.full((n,), fk.FP8_MAX))
    y = fk.fp8_linear_reference(x, wq, ws.view(-1), bias)
    xq, xs = fk.quantize_rows_reference(x)
    ref = (xq.float() * xs) @ (wq.float() * ws).t() + bias  # torch's fp32 matmul
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # fp8_linear (the engine's entry) on CPU is the reference
    torch.testing.assert_close(fk.fp8_linear(x, wq, ws.view(-1), bias), y)
    assert rel(y, x @ w.t() + bias) < QUANT_NOISE
    # a bf16 x: quantized from its bf16 values, computed in fp32, rounded to bf16
    yb = fk.fp8_linear(x.bfloat16(), wq, ws.view(-1), bias.bfloat16())
    assert yb.dtype == torch.bfloat16 and rel(yb, y) < 3e-2  # x rounded to bf16 first


def test_zero_rows_and_empty_batches():
    q, s = fk.quantize_rows_reference(torch.zeros(2, 32))
    assert torch.isfinite(s).all() and not q.float().any()
    wq, ws = fk.quantize_rows_reference(torch.randn(16, 32))
    assert fk.fp8_linear(torch.empty(0, 32), wq, ws.view(-1)).shape == (0, 16)


def test_fp8_linear_loads_rows_with_their_own_scales():
    lin = Fp8Linear(64, 48, bias=False, dtype=torch.float32, device="cpu")
    w = torch.randn(48, 64)
    w[:16] *= 100  # the first part's scale must not flatten the second's
    lin.load_weight_rows(0, 16, w[:16])
    lin.load_weight_rows(16, 48, w[16:])
    deq = fk.dequantize_rows(lin.weight, lin.weight_scale)
    assert rel(deq, w) < 0.04 and rel(deq[16:], w[16:]) < 0.04
    with pytest.raises(ValueError, match="fp8 linear"):
        lin.load_weight_rows(0, 8, torch.randn(8, 63))


def test_settings_and_refusals():
    check_quantization(None)
    check_quantization("fp8")
    assert quant_config(None) is None and quant_config("fp8").name == "fp8"
    for name in ("awq", "gptq", "bitsandbytes"):
        with pytest.raises(ValueError, match=f"'{name}' is not supported; supported: fp8"):
            check_quantization(name)
    with pytest.raises(ValueError, match="quantization: must be one of fp8"):
        EngineArgs(model="x", quantization="fp4").validate()
    EngineArgs(model="x", quantization="fp8").validate()


def test_gpus_without_fp8_tensor_cores_are_named():
    for cap, name in [((8, 0), "NVIDIA A100-SXM4-80GB"), ((8, 6), "NVIDIA GeForce RTX 3090")]:
        msg = fp8_device_error(cap, name)
        assert f"{name} has compute capability {cap[0]}.{cap[1]}" in msg
        assert "unset QUANTIZATION" in msg
    for cap in [(8, 9), (9, 0), (10, 0)]:
        assert fp8_device_error(cap, "x") is None


@pytest.mark.parametrize(
    "family, extra",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("phi3", {}),
        ("gemma3", {}),
        ("llama", {"attention_bias": True}),
    ],
)
def test_models_with_fp8_linears_track_their_fp32_selves(family, extra, tmp_path):
    make_tiny_model(family, str(tmp_path), **extra)
    cfg = ModelConfig.from_dir(str(tmp_path))
    ref = load_model(str(tmp_path), cfg, torch.float32, "cpu", load_format="safetensors")
    fp8 = load_model(
        str(tmp_path), cfg, torch.float32, "cpu", load_format="safetensors", quantization="fp8"
    )
    # exactly the declared linears are FP8; embeddings, lm_head and norms keep the model dtype
    fp8_params = {n for n, p in fp8.named_parameters() if p.dtype == torch.float8_e4m3fn}
    expected = {
        f"layers.{i}.{lin}.weight"
        for i in range(cfg.num_layers)
        for lin in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    assert fp8_params == expected
    # measured: logits rel err 0.03-0.07 (Gemma 3's sandwich norms: 0.13), top-1 agreement 0.89-0.94
    tracks_its_fp32_self(fp8, ref, cfg, family)


def tracks_its_fp32_self(fp8, ref, cfg: ModelConfig, family: str) -> torch.Tensor:
    """The FP8 model's prefill and decode logits within 15 % of the fp32 model's, the same top-1
    token at 85 % of positions; returns the FP8 logits."""
    toks = list(range(3, 39))
    a = prefill_then_decode(ref, cfg, toks)
    b = prefill_then_decode(fp8, cfg, toks)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"{family}: logits rel err {rel(b, a):.4f}, top-1 agreement {agree:.2f}")
    assert rel(b, a) < 0.15
    assert agree >= 0.85
    return b


def test_pack_round_trip_and_no_cross_use(tmp_path):
    d = str(tmp_path)
    make_tiny_model("llama", d)
    cfg = ModelConfig.from_dir(d)
    first = load_model(d, cfg, torch.float32, "cpu", quantization="fp8")
    path = first.load_stats["pack_written"]
    assert path == pack_path(d, torch.float32, quantization="fp8") and path.endswith(
        "-fp8-v1.cbpack"
    )
    second = load_model(d, cfg, torch.float32, "cpu", quantization="fp8")
    assert second.load_stats["source"] == "pack" and second.load_stats["path"] == path
    assert second.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    toks = list(range(3, 30))
    assert torch.equal(
        prefill_then_decode(first, cfg, toks), prefill_then_decode(second, cfg, toks)
    )
    # in bf16 the FP8 pack holds each linear in half the bytes (plus an fp32 scale per row)
    bf16 = load_model(d, cfg, torch.bfloat16, "cpu")
    bf16_fp8 = load_model(d, cfg, torch.bfloat16, "cpu", quantization="fp8")
    assert bf16.load_stats["source"] == bf16_fp8.load_stats["source"] == "safetensors"
    plain = {e.name: e for e in read_pack(bf16.load_stats["pack_written"]).entries}
    quant = {e.name: e for e in read_pack(bf16_fp8.load_stats["pack_written"]).entries}
    linears = [n for n, e in quant.items() if e.dtype == "float8_e4m3fn"]
    assert len(linears) == 4 * cfg.num_layers
    for name in linears:
        assert 2 * quant[name].nbytes == plain[name].nbytes
        scale = quant[name.replace(".weight", ".weight_scale")]
        assert scale.dtype == "float32" and scale.shape == (plain[name].shape[0],)
    # a pack of another scheme (or none) is refused, also when handed over by path
    load_model(d, cfg, torch.float32, "cpu")  # the fp32 pack
    with pytest.raises(PackError, match="quantization None, not 'fp8'"):
        load_model_from_pack(
            pack_path(d, torch.float32),
            None,
            cfg,
            torch.float32,
            torch.device("cpu"),
            quantization="fp8",
        )
    with pytest.raises(PackError, match="quantization 'fp8', not None"):
        load_model_from_pack(path, None, cfg, torch.float32, torch.device("cpu"))


def test_dummy_weights_with_fp8(tmp_path):
    make_tiny_model("llama", str(tmp_path))
    cfg = ModelConfig.from_dir(str(tmp_path))
    model = load_model(
        str(tmp_path), cfg, torch.float32, "cpu", load_format="dummy", quantization="fp8"
    )
    lin = model.layers[1].mlp.gate_up_proj
    deq = fk.dequantize_rows(lin.weight, lin.weight_scale)
    assert 0.015 < deq.std().item() < 0.025  # N(0, 0.02), quantized
    assert torch.isfinite(prefill_then_decode(model, cfg, list(range(3, 25)))).all()


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_moe_models_with_fp8_experts_track_their_fp32_selves(family, tmp_path):
    """QUANTIZATION=fp8 on a bf16/fp32 MoE checkpoint: the experts are FP8 too (one scale per
    expert and output row), the routers and Qwen2-MoE's shared expert keep the model dtype; the
    logits follow the unquantized model's, and the pack keeps the FP8 experts byte for byte."""
    d = str(tmp_path)
    make_tiny_model(family, d)
    cfg = ModelConfig.from_dir(d)
    ref = load_model(d, cfg, torch.float32, "cpu", load_format="safetensors")
    fp8 = load_model(d, cfg, torch.float32, "cpu", quantization="fp8")  # writes the FP8 pack
    assert fp8.load_stats["source"] == "safetensors"
    fp8_params = {n for n, p in fp8.named_parameters() if p.dtype == torch.float8_e4m3fn}
    sparse = [i for i in range(cfg.num_layers) if cfg.moe.is_sparse(i)]
    assert sparse
    for i in sparse:
        for proj in ("gate_up_proj", "down_proj"):
            name = f"layers.{i}.mlp.experts.{proj}"
            assert name in fp8_params
            values, scale = fp8.get_parameter(name), fp8.get_parameter(name + "_scale")
            assert scale.shape == values.shape[:2] and scale.dtype == torch.float32
            # each (expert, row) quantized with its own scale: the checkpoint's rows come back
            # within e4m3's rounding
            want = ref.get_parameter(name)
            got = values.float() * scale[..., None]
            assert rel(got, want) < 0.05
        assert fp8.layers[i].mlp.gate.weight.dtype == torch.float32  # the router
    assert not any("shared_expert" in n for n in fp8_params)
    # measured: logits rel err 0.04-0.08, top-1 agreement 0.89-0.97
    b = tracks_its_fp32_self(fp8, ref, cfg, family)
    again = load_model(d, cfg, torch.float32, "cpu", quantization="fp8")  # from the FP8 pack
    assert again.load_stats["source"] == "pack"
    for name in fp8_params:
        assert torch.equal(
            again.get_parameter(name).view(torch.uint8), fp8.get_parameter(name).view(torch.uint8)
        )
    assert torch.equal(prefill_then_decode(again, cfg, list(range(3, 39))), b)


def test_a_scheme_without_experts_refuses_a_moe_model_in_one_line(tmp_path):
    from engine.quant.base import QuantConfig

    make_tiny_model("qwen3-moe", str(tmp_path))
    cfg = ModelConfig.from_dir(str(tmp_path))
    quant_config("fp8").check_model(cfg)  # FP8 has experts
    with pytest.raises(ValueError, match="has no mixture-of-experts layers .*unset QUANTIZATION"):
        QuantConfig().check_model(cfg)


def test_fp8_moe_dummy_weights(tmp_path):
    """Random FP8 experts for load_format "dummy" (N(0, 0.02), quantized). (FP8 MoE checkpoints:
    tests/test_fp8_moe_checkpoints.py.)"""
    make_tiny_model("qwen3-moe", str(tmp_path))
    cfg = ModelConfig.from_dir(str(tmp_path))
    model = load_model(
        str(tmp_path), cfg, torch.float32, "cpu", load_format="dummy", quantization="fp8"
    )
    experts = model.layers[0].mlp.experts
    deq = experts.down_proj.float() * experts.down_proj_scale[..., None]
    assert 0.015 < deq.std().item() < 0.025
    assert torch.isfinite(prefill_then_decode(model, cfg, list(range(3, 25)))).all()


def test_tensor_parallel_fp8_tracks_one_process(tmp_path):
    """Each rank quantizes its slice (row-parallel ranks scale their own input columns), so TP=2 is
    close to TP=1, not bitwise equal."""
    make_tiny_model("llama", str(tmp_path))
    kwargs = dict(
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=64,
        quantization="fp8",
        pack_dir=str(tmp_path / "packs"),
    )
    prompts = [list(range(5, 30)), [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    ref = LLM(model=str(tmp_path), **kwargs).generate(prompts, params)
    tp = LLM(model=str(tmp_path), tensor_parallel_size=2, **kwargs)
    try:
        got = tp.generate(prompts, params)
        assert tp.engine.runner.model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    finally:
        tp.shutdown()
    packs = sorted(os.listdir(tmp_path / "packs"))
    print(packs)
    assert any("fp8" in p and "rank" in p for p in packs)
    for a, b in zip(ref, got):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        print(ta, tb)
        assert ta[:6] == tb[:6]
        diffs = [
            abs(x[t].logprob - y[t].logprob)
            for x, y, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:])
        ]
        assert max(diffs) < 0.1, max(diffs)
