"""FP8 mixture-of-experts checkpoints (Qwen3-MoE, block scales as Qwen3-*-FP8 publish them), read by
the engine as transformers reads them.

transformers' FineGrainedFP8 quantizer writes the checkpoint: each expert's FP8 weights under their
own names, and each layer's expert scales stacked (experts.gate_up_proj_scale_inv [E, ...]). The
hub's checkpoints carry one scale per expert and projection instead
(experts.E.gate_proj.weight_scale_inv); the engine cuts the stacked ones into those
(engine.models.prequantized.per_expert_scales), and transformers' own loader, which dequantizes on
a machine without a GPU, reads the cut checkpoint: that is the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from accuracy import engine_prompt_logprobs
from engine.checkpoint_quant import checkpoint_quantization
from engine.config import ModelConfig
from engine.model_support import check_model_config
from engine.models import load_model
from engine.models.prequantized import (
    checkpoint_weights,
    expert_layout,
    per_expert_scales,
    weight_rows,
)
from engine.models.weights import iter_safetensors
from tiny_models import PagedSeq, make_step, make_tiny_model

BLOCK = (32, 32)


def _transformers_version() -> tuple[int, ...]:
    import transformers

    return tuple(int(part) for part in transformers.__version__.split(".")[:2])


# transformers 5.17 (the GPU machines') writes these checkpoints but its loader fails on its own
# expert scales ("shape '[64, 32]' is invalid for input of size 4096"); 5.23 (constraints.txt)
# reads them.
needs_reference_loader = pytest.mark.skipif(
    _transformers_version() < (5, 23),
    reason="transformers' loader reads FP8 MoE checkpoints from 5.23 on",
)
TOKS = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    """bf16: a tiny Qwen3-MoE in bf16; transformers: its FP8 checkpoint as transformers' quantizer
    writes it; hub: the same with every expert's own scale."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    root = tmp_path_factory.mktemp("fp8-moe")
    make_tiny_model("qwen3-moe", str(root / "float32"))
    bf16 = AutoModelForCausalLM.from_pretrained(root / "float32", dtype=torch.bfloat16)
    bf16.save_pretrained(root / "bf16")
    # The quantizer itself is plain torch; only its environment check asks for a GPU.
    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            root / "bf16",
            quantization_config=FineGrainedFP8Config(weight_block_size=BLOCK),
            dtype=torch.bfloat16,
            device_map="cpu",
        )
        quantized.save_pretrained(root / "transformers")
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check
    hub = root / "hub"
    hub.mkdir()
    (hub / "config.json").write_text((root / "transformers" / "config.json").read_text())
    fmt = checkpoint_quantization(_config(root / "transformers"))
    written = {}
    for shard in sorted((root / "transformers").glob("*.safetensors")):
        written.update(load_file(shard))
    inter = _config(root / "transformers")["moe_intermediate_size"]
    cut = per_expert_scales(iter(written.items()), fmt, expert_layout("qwen3_moe", inter))
    save_file({k: v.contiguous() for k, v in cut}, hub / "model.safetensors")
    return {name: str(root / name) for name in ("bf16", "transformers", "hub")}


def _config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _transformers_dequantized(path: str):
    """transformers' model of the FP8 checkpoint at `path`, dequantized to bf16 as its loader does
    by itself on a machine without a GPU (asked for, so that a GPU machine gives the same)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    config = FineGrainedFP8Config(weight_block_size=BLOCK, dequantize=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, output_loading_info=True, quantization_config=config
    )
    return model.eval(), info


def test_fp8_moe_checkpoints_pass_the_pre_download_check(moe_dirs) -> None:
    assert check_model_config(_config(moe_dirs["hub"])) == ("Qwen3MoeForCausalLM", "qwen3_moe")


@needs_reference_loader
def test_transformers_reads_every_expert_scale_of_the_cut_checkpoint(moe_dirs) -> None:
    _, info = _transformers_dequantized(moe_dirs["hub"])
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@needs_reference_loader
@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_the_expert_weights_read_are_transformers_own(moe_dirs, layout) -> None:
    """Each expert's FP8 weight times its block scales, in bf16, is exactly the weight transformers
    dequantizes (the gate and up halves of its stacked gate_up_proj, its down_proj), and within
    e4m3's rounding of the bf16 weight the quantizer started from (a scale cut from the wrong
    block would be far off)."""
    from transformers import AutoModelForCausalLM

    path = moe_dirs[layout]
    fmt = checkpoint_quantization(_config(path))
    inter = _config(path)["moe_intermediate_size"]
    layout_of_experts = expert_layout("qwen3_moe", inter)
    ours = dict(checkpoint_weights(iter_safetensors(path), fmt, experts=layout_of_experts))
    hf, _ = _transformers_dequantized(moe_dirs["hub"])
    original = AutoModelForCausalLM.from_pretrained(moe_dirs["bf16"], dtype=torch.bfloat16)
    cfg = hf.config
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse
    for layer in sparse:
        experts = hf.model.layers[layer].mlp.experts
        source = original.model.layers[layer].mlp.experts
        for e in range(cfg.num_experts):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            for proj, rows in (("gate_proj", slice(inter)), ("up_proj", slice(inter, None))):
                _same(ours[f"{prefix}.{proj}.weight"], experts.gate_up_proj[e, rows], prefix)
                _near(ours[f"{prefix}.{proj}.weight"], source.gate_up_proj[e, rows], prefix)
            _same(ours[f"{prefix}.down_proj.weight"], experts.down_proj[e], prefix)
            _near(ours[f"{prefix}.down_proj.weight"], source.down_proj[e], prefix)


def _same(mine: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(mine.to(torch.bfloat16), theirs, rtol=0, atol=0, msg=what)


def _near(mine: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """Within e4m3's rounding: 2^-4 relative, and half its smallest step (2^-10 of the block's
    scale, amax / 448) near zero."""
    source = source.float()
    atol = source.abs().max().item() / 448 / 1024
    torch.testing.assert_close(mine.float(), source, rtol=2**-4, atol=atol, msg=what)


def _logits(model, cfg: ModelConfig) -> torch.Tensor:
    """The model's prefill logits of TOKS through a paged cache (the torch attention on CPU)."""
    from engine.attention import kv_cache_shape

    block, num_blocks = 4, 16
    kv = torch.zeros(
        kv_cache_shape(cfg.num_layers, num_blocks, block, cfg.num_kv_heads, cfg.head_dim)
    )
    ids, positions, meta = make_step([PagedSeq(TOKS, list(range(num_blocks)))], [len(TOKS)], block)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, kv, meta)).float()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_reference_loader
def test_fp8_moe_logits_stay_as_near_the_dense_forward_as_quantizing_the_bf16_model(
    moe_dirs,
) -> None:
    """The engine serves the FP8 checkpoint's experts as FP8 (weights quantized again per row,
    activations per token): its float32 logits stay as near transformers' dequantized forward as
    the engine's own QUANTIZATION=fp8 of the bf16 model stays near that model's forward, and its
    argmax mostly agrees."""
    from transformers import AutoModelForCausalLM

    hub, bf16 = moe_dirs["hub"], moe_dirs["bf16"]
    with torch.no_grad():
        dense = _transformers_dequantized(hub)[0].float()(torch.tensor([TOKS])).logits[0]
        bf16_model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
        bf16_dense = bf16_model(torch.tensor([TOKS])).logits[0]
    cfg = ModelConfig.from_dir(hub)
    model = load_model(hub, cfg, torch.float32, "cpu", load_format="safetensors")
    assert type(model.layers[0].mlp.experts).__name__ == "Fp8StackedExperts"
    ours = _logits(model, cfg)
    bf16_cfg = ModelConfig.from_dir(bf16)
    online = load_model(
        bf16, bf16_cfg, torch.float32, "cpu", load_format="safetensors", quantization="fp8"
    )
    error, online_error = _relative(ours, dense), _relative(_logits(online, bf16_cfg), bf16_dense)
    print(f"FP8 checkpoint: {error:.4f}; QUANTIZATION=fp8 of the bf16 model: {online_error:.4f}")
    assert error < 1.5 * online_error
    assert (ours.argmax(-1) == dense.argmax(-1)).float().mean().item() >= 0.7


def test_a_stacked_scale_that_straddles_gate_and_up_is_refused() -> None:
    """56 rows of gate and 56 of up in 32-row blocks: the second block holds both."""
    fmt = checkpoint_quantization(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    )
    stacked = [("model.layers.0.mlp.experts.gate_up_proj_scale_inv", torch.ones(4, 4, 2))]
    with pytest.raises(ValueError, match="block boundary"):
        list(per_expert_scales(iter(stacked), fmt, expert_layout("qwen3_moe", 56)))


def test_a_block_scale_grid_of_one_column_may_come_flat() -> None:
    """transformers 5.17's quantizer writes the [2, 1] grid of a [64, 32] weight in 32x32 blocks as
    [2] (each expert's down_proj in the tiny model here; 5.23 keeps [2, 1]): the same scales. A flat
    scale of another length is still refused."""
    fmt = checkpoint_quantization(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    )
    weight = torch.randn(64, 32).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.5, 2.0])
    flat, grid = weight_rows(weight, scale, fmt), weight_rows(weight, scale[:, None], fmt)
    assert torch.equal(flat, grid)
    assert torch.equal(flat[32:], weight[32:].float() * 2.0)
    with pytest.raises(ValueError, match="scale grid"):
        weight_rows(weight, torch.ones(3), fmt)


def test_the_pack_of_an_fp8_moe_checkpoint_holds_its_fp8_experts(moe_dirs, tmp_path) -> None:
    """The first load writes an FP8 pack (the experts' e4m3 values and scales among its tensors);
    the next start reads it byte for byte, and the engine's greedy tokens are the same from
    either."""
    from engine import LLM, SamplingParams
    from test_fp8_checkpoints import reloaded_from_its_fp8_pack  # needs compressed-tensors

    hub = moe_dirs["hub"]
    again = reloaded_from_its_fp8_pack(hub, str(tmp_path))
    names = [name for name, _ in again.named_parameters()]
    assert any(name.endswith("experts.gate_up_proj_scale") for name in names)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for load_format in ("safetensors", "pack"):
        llm = LLM(
            model=hub,
            device="cpu",
            dtype="float32",
            num_kv_blocks=32,
            block_size=4,
            load_format=load_format,
            pack_dir=str(tmp_path),
        )
        try:
            tokens.append(llm.generate([TOKS[:12]], params)[0].outputs[0].token_ids)
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_fp8_moe_checkpoint_on_the_gpu_matches_the_cpu_reference(moe_dirs) -> None:
    """The FP8 MoE checkpoint served on the GPU in bf16 (the router's Triton top-k, the fused FP8
    experts, CUDA graphs) against the same checkpoint on the CPU in float32: the prompt's
    log-probabilities agree within bf16's reach, as the dense FP8 checkpoint's do."""
    hub = moe_dirs["hub"]
    cpu = torch.tensor(
        engine_prompt_logprobs(hub, TOKS, max_model_len=128, dtype="float32", device="cpu")
    )
    gpu = torch.tensor(
        engine_prompt_logprobs(hub, TOKS, max_model_len=128, dtype="bfloat16", device="cuda")
    )
    diff = (gpu - cpu).abs()
    print(f"GPU bf16 against CPU float32 log-probabilities: mean {diff.mean():.4f}")
    print(f"GPU bf16 against CPU float32 log-probabilities: max {diff.max():.4f}")
    assert diff.mean().item() < 0.08 and diff.max().item() < 0.25
