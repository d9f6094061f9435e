"""FP8 checkpoints written by tools this project did not write, read by the engine as transformers
reads them.

The compressed-tensors checkpoints in tests/fixtures/fp8/ come from llm-compressor
(make_checkpoints.py there: FP8_DYNAMIC, FP8 with static activation scales, FP8_BLOCK); the
block-FP8 checkpoint of quant_method "fp8" is written here by transformers' own FineGrainedFP8
quantizer. The references are transformers' own loaders: compressed-tensors' decompression, and
transformers' dequantizing load of "fp8" checkpoints on a machine without a GPU.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.checkpoint_quant import checkpoint_quantization
from engine.config import ModelConfig
from engine.model_support import check_model_config
from engine.models import load_model
from tiny_models import PagedSeq, make_step

pytest.importorskip("compressed_tensors")

FIXTURES = Path(__file__).parent / "fixtures" / "fp8"
CT_SCHEMES = {  # fixture -> (weight scales, activations), as llm-compressor's presets define them
    "fp8-dynamic": ("channel", "dynamic"),
    "fp8": ("tensor", "static"),
    "fp8-block": ("block", "dynamic"),
}
BLOCK = 4
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def hf_fp8_dir(tmp_path_factory) -> str:
    """A block-FP8 checkpoint (quant_method fp8, 64x128 blocks) written by transformers'
    FineGrainedFP8 quantizer from the bf16 weights the fixtures were made from (dequantized)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    source = _dense_hf(FIXTURES / "fp8-dynamic", torch.bfloat16)
    base = tmp_path_factory.mktemp("bf16")
    source.save_pretrained(base)
    out = tmp_path_factory.mktemp("hf-fp8")
    # The quantizer itself is plain torch; only its environment check asks for a GPU.
    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            base,
            quantization_config=FineGrainedFP8Config(weight_block_size=(64, 128)),
            dtype=torch.bfloat16,
            device_map="cpu",
        )
        quantized.save_pretrained(out)
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check
    return str(out)


def _dense_hf(path, dtype=torch.float32):
    """transformers' own dense model of an FP8 checkpoint (compressed-tensors decompressed, or an
    "fp8" checkpoint dequantized, as transformers does without a GPU)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    config = json.loads((Path(path) / "config.json").read_text())
    extra = {}
    if config["quantization_config"]["quant_method"] == "compressed-tensors":
        extra["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    return model.to(dtype).eval()


def _config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def test_the_formats_are_read_as_their_tools_wrote_them(hf_fp8_dir) -> None:
    for name, (scales, acts) in CT_SCHEMES.items():
        fmt = checkpoint_quantization(_config(FIXTURES / name))
        assert (fmt.method, fmt.weight_scales, fmt.activations) == (
            "compressed-tensors",
            scales,
            acts,
        )
        assert fmt.block == ((128, 128) if scales == "block" else None)
    fmt = checkpoint_quantization(_config(hf_fp8_dir))
    assert (fmt.method, fmt.weight_scales, fmt.block, fmt.scale_name) == (
        "fp8",
        "block",
        (64, 128),
        "weight_scale_inv",
    )


def _edited(path: str, value) -> dict:
    cfg = copy.deepcopy(_config(FIXTURES / "fp8-dynamic"))
    *parents, leaf = path.split(".")
    node = cfg
    for key in parents:
        node = node[key]
    node[leaf] = value
    return cfg


@pytest.mark.parametrize(
    "path, value, field",
    [
        ("quantization_config", {"quant_method": "awq", "bits": 4}, "quant_method: 'awq'"),
        ("quantization_config", {"quant_method": "gptq", "bits": 4}, "quant_method: 'gptq'"),
        ("quantization_config", {"quant_method": "bitsandbytes"}, "quant_method"),
        # compressed-tensors' W4A16 (int4 weights packed into int32), as llm-compressor writes it
        ("quantization_config.format", "pack-quantized", "format"),
        ("quantization_config.config_groups.group_0.weights.num_bits", 4, "weights"),
        ("quantization_config.config_groups.group_0.weights.type", "int", "weights"),
        ("quantization_config.kv_cache_scheme", {"num_bits": 8, "type": "float"}, "kv_cache"),
        ("quantization_config.ignore", ["lm_head", "re:.*down_proj"], "ignore"),
        ("quantization_config.config_groups.group_0.targets", ["re:.*q_proj"], "targets"),
    ],
)
def test_other_quantizations_are_refused_before_download(path, value, field) -> None:
    """engine.model_support's pre-download check names the field (cache runs it on config.json
    before any weight moves)."""
    with pytest.raises(ValueError, match=field):
        check_model_config(_edited(path, value))


def test_fp8_moe_checkpoints_are_refused() -> None:
    cfg = _config(FIXTURES / "fp8-dynamic")
    cfg.update(architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="FP8 experts"):
        check_model_config(cfg)


def _all_checkpoints(hf_fp8_dir) -> list[str]:
    return [str(FIXTURES / name) for name in CT_SCHEMES] + [hf_fp8_dir]


def _rounded_as_reference(path: str):
    """compressed-tensors decompresses in its scales' dtype (bf16 in these checkpoints), so its
    weights are the engine's exact float32 products rounded to bf16; transformers' "fp8" dequantizes
    in float32."""
    if checkpoint_quantization(_config(path)).method == "compressed-tensors":
        return lambda w: w.to(torch.bfloat16).float()
    return lambda w: w


def test_dequantized_weights_are_transformers_own(hf_fp8_dir) -> None:
    """Every weight the engine loads equals transformers' dense weight of the same checkpoint (to
    the rounding of its dtype), fused layouts unfused by name."""
    for path in _all_checkpoints(hf_fp8_dir):
        model = load_model(
            path, ModelConfig.from_dir(path), torch.float32, "cpu", load_format="safetensors"
        )
        hf = dict(_dense_hf(path).named_parameters())
        layer = model.layers[1]
        q = hf["model.layers.1.self_attn.q_proj.weight"]
        k = hf["model.layers.1.self_attn.k_proj.weight"]
        v = hf["model.layers.1.self_attn.v_proj.weight"]
        rounded = _rounded_as_reference(path)
        close = dict(rtol=0, atol=0, msg=lambda m: f"{path}: {m}")
        torch.testing.assert_close(
            rounded(layer.self_attn.qkv_proj.weight), torch.cat([q, k, v]), **close
        )
        gate = hf["model.layers.1.mlp.gate_proj.weight"]
        up = hf["model.layers.1.mlp.up_proj.weight"]
        torch.testing.assert_close(
            rounded(layer.mlp.gate_up_proj.weight), torch.cat([gate, up]), **close
        )
        down = hf["model.layers.1.mlp.down_proj.weight"]
        torch.testing.assert_close(rounded(layer.mlp.down_proj.weight), down, **close)


def _prefill_logits(model, cfg: ModelConfig, toks: list[int]) -> torch.Tensor:
    from engine.attention import kv_cache_shape

    kv = torch.zeros(
        kv_cache_shape(cfg.num_layers, NUM_BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    )
    seq = PagedSeq(toks, list(range(NUM_BLOCKS)))
    ids, positions, meta = make_step([seq], [len(toks)], BLOCK)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, kv, meta))


def test_logits_match_transformers_dense_forward(hf_fp8_dir) -> None:
    """Float32 prefill logits against transformers' forward on its dense model: to float32 rounding
    where both dequantize in float32, and within 1% of the largest logit where compressed-tensors'
    weights are rounded to bf16 (the weights test above shows that rounding is the whole
    difference)."""
    toks = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    for path in _all_checkpoints(hf_fp8_dir):
        cfg = ModelConfig.from_dir(path)
        model = load_model(path, cfg, torch.float32, "cpu", load_format="safetensors")
        ours = _prefill_logits(model, cfg, toks)
        with torch.no_grad():
            ref = _dense_hf(path)(torch.tensor([toks]), use_cache=False).logits[0]
        exact = checkpoint_quantization(_config(path)).method == "fp8"
        bound = 1e-4 if exact else 0.01 * ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= bound, path


def test_an_incomplete_checkpoint_names_the_missing_scale(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copy(FIXTURES / "fp8-dynamic" / "config.json", tmp_path / "config.json")
    tensors = load_file(FIXTURES / "fp8-dynamic" / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj"):
        load_model(
            str(tmp_path),
            ModelConfig.from_dir(str(tmp_path)),
            torch.float32,
            "cpu",
            load_format="safetensors",
        )
