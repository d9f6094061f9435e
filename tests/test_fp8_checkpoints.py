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
from safetensors.torch import load_file

from engine.checkpoint_quant import checkpoint_quantization
from engine.config import ModelConfig
from engine.distributed.sharding import Shard
from engine.model_support import check_model_config
from engine.models import load_model
from engine.models.prequantized import checkpoint_weights, weight_rows
from engine.models.weights import iter_safetensors
from engine.quant.base import QuantizedRows
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
TOKS = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()


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


@pytest.mark.parametrize(
    "ignore",
    [
        ["lm_head", "re:.*mlp.gate$"],  # Qwen3-MoE's router, as llm-compressor's presets write it
        ["lm_head", "re:.*block_sparse_moe.gate"],  # Mixtral's
        ["lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"],  # Qwen2-MoE's
        ["lm_head", "model.layers.0.mlp.gate"],
    ],
)
def test_a_moe_checkpoint_may_keep_its_routers_unquantized(ignore) -> None:
    """A mixture of experts' routers (and Qwen2-MoE's shared-expert gate) stay in high precision in
    the engine anyway: a checkpoint that leaves them unquantized passes the pre-download check."""
    cfg = _edited("quantization_config.ignore", ignore)
    cfg.update(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2)
    cfg.update(moe_intermediate_size=32, model_type="qwen3_moe")
    assert check_model_config(cfg)[1] == "qwen3_moe"


def _all_checkpoints(hf_fp8_dir) -> list[str]:
    return [str(FIXTURES / name) for name in CT_SCHEMES] + [hf_fp8_dir]


def _rounded_as_reference(path: str):
    """compressed-tensors decompresses in its scales' dtype (bf16 in these checkpoints), so its
    weights are the exact float32 products rounded to bf16; transformers' "fp8" dequantizes in
    float32."""
    if checkpoint_quantization(_config(path)).method == "compressed-tensors":
        return lambda w: w.to(torch.bfloat16).float()
    return lambda w: w


def _values(rows) -> torch.Tensor:
    return rows.dequantize() if isinstance(rows, QuantizedRows) else rows.float()


def test_the_weights_read_are_transformers_own(hf_fp8_dir) -> None:
    """Each FP8 weight paired with its scale stands for exactly the weight transformers
    dequantizes (to the rounding of transformers' dtype)."""
    for path in _all_checkpoints(hf_fp8_dir):
        fmt = checkpoint_quantization(_config(path))
        ours = dict(checkpoint_weights(iter_safetensors(path), fmt))
        assert not any(name.endswith(("_scale", "_scale_inv")) for name in ours), path
        rounded = _rounded_as_reference(path)
        dense = dict(_dense_hf(path).named_parameters())
        linears = [n for n in dense if n.endswith("proj.weight")]
        assert len(linears) == 14
        for name in linears:
            kept = isinstance(ours[name], QuantizedRows)
            assert kept == (fmt.weight_scales != "block"), (path, name)
            torch.testing.assert_close(
                rounded(_values(ours[name])), dense[name], rtol=0, atol=0, msg=f"{path} {name}"
            )


def test_per_tensor_and_per_channel_fp8_values_are_served_as_they_are() -> None:
    """The engine's FP8 linears hold the checkpoint's own FP8 bytes and scales (q, k and v each with
    its own per-tensor scale in the fused qkv); block-scaled weights are quantized again per
    channel, within e4m3's rounding of the checkpoint's values."""
    for name in CT_SCHEMES:
        path = str(FIXTURES / name)
        model = load_model(
            path, ModelConfig.from_dir(path), torch.float32, "cpu", load_format="safetensors"
        )
        qkv = model.layers[1].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn
        tensors = load_file(Path(path) / "model.safetensors")
        parts = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
        codes = torch.cat([tensors[f"{p}.weight"] for p in parts])
        scales = torch.cat(
            [
                tensors[f"{p}.weight_scale"].float().reshape(-1).expand(len(tensors[f"{p}.weight"]))
                if tensors[f"{p}.weight_scale"].numel() in (1, len(tensors[f"{p}.weight"]))
                else torch.full((len(tensors[f"{p}.weight"]),), float("nan"))
                for p in parts
            ]
        )
        if CT_SCHEMES[name][0] == "block":
            fmt = checkpoint_quantization(_config(path))
            want = torch.cat(
                [
                    _values(weight_rows(tensors[f"{p}.weight"], tensors[f"{p}.weight_scale"], fmt))
                    for p in parts
                ]
            )
            have = qkv.weight.float() * qkv.weight_scale[:, None]
            assert ((have - want).norm() / want.norm()).item() < 2**-4
        else:
            assert torch.equal(qkv.weight.view(torch.uint8), codes.view(torch.uint8)), name
            assert torch.equal(qkv.weight_scale, scales), name


def _prefill_logits(model, cfg: ModelConfig, toks: list[int]) -> torch.Tensor:
    from engine.attention import kv_cache_shape

    kv = torch.zeros(
        kv_cache_shape(cfg.num_layers, NUM_BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    )
    seq = PagedSeq(toks, list(range(NUM_BLOCKS)))
    ids, positions, meta = make_step([seq], [len(toks)], BLOCK)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, kv, meta))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp8_dynamic_logits_are_transformers_own_fp8_forward() -> None:
    """FP8_DYNAMIC (per-channel weights, per-token activations) is the engine's own scheme: its
    float32 prefill logits equal compressed-tensors' quantized forward in transformers."""
    from transformers import AutoModelForCausalLM

    path = str(FIXTURES / "fp8-dynamic")
    cfg = ModelConfig.from_dir(path)
    ours = _prefill_logits(
        load_model(path, cfg, torch.float32, "cpu", load_format="safetensors"), cfg, TOKS
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([TOKS]), use_cache=False).logits[0].float()
    assert _relative(ours, ref) < 1e-5


@pytest.mark.parametrize("name", ["fp8", "fp8-block", "hf-fp8"])
def test_other_fp8_formats_stay_near_the_dense_forward(name, hf_fp8_dir) -> None:
    """Static activation scales and block scales are served with the engine's per-token
    activations and per-channel weights: the logits stay as near transformers' dense forward as
    FP8_DYNAMIC's own (the measured error of quantization itself on this tiny random model) and
    its argmax mostly agrees."""
    from transformers import AutoModelForCausalLM

    path = hf_fp8_dir if name == "hf-fp8" else str(FIXTURES / name)
    cfg = ModelConfig.from_dir(path)
    ours = _prefill_logits(
        load_model(path, cfg, torch.float32, "cpu", load_format="safetensors"), cfg, TOKS
    )
    with torch.no_grad():
        dense = _dense_hf(path)(torch.tensor([TOKS]), use_cache=False).logits[0]
        fp8_dynamic = FIXTURES / "fp8-dynamic"
        dynamic_ref = AutoModelForCausalLM.from_pretrained(fp8_dynamic, dtype=torch.float32)
        dynamic_error = _relative(
            dynamic_ref(torch.tensor([TOKS]), use_cache=False).logits[0],
            _dense_hf(fp8_dynamic)(torch.tensor([TOKS]), use_cache=False).logits[0],
        )
    error = _relative(ours, dense)
    print(
        f"{name}: logits error to the dense forward {error:.4f} "
        f"(FP8_DYNAMIC's: {dynamic_error:.4f})"
    )
    assert error < 1.5 * dynamic_error
    assert (ours.argmax(-1) == dense.argmax(-1)).float().mean().item() >= 0.7


def test_an_incomplete_checkpoint_names_the_missing_scale(tmp_path) -> None:
    from safetensors.torch import save_file

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


def test_the_pack_of_an_fp8_checkpoint_holds_its_fp8_weights(tmp_path) -> None:
    """The first load writes an FP8 pack (keyed by the scheme the checkpoint implies); the next
    start reads it: the same FP8 bytes and scales, no safetensors read."""
    reloaded_from_its_fp8_pack(str(FIXTURES / "fp8-dynamic"), str(tmp_path))


def reloaded_from_its_fp8_pack(path: str, pack_dir: str):
    """Load an FP8 checkpoint twice: the first load reads safetensors and writes an FP8 pack
    under pack_dir, the second reads that pack with the same bytes in every parameter. Returns
    the second model."""
    cfg = ModelConfig.from_dir(path)
    first = load_model(path, cfg, torch.float32, "cpu", pack_dir=pack_dir)
    assert first.load_stats["source"] == "safetensors"
    assert "-fp8-" in first.load_stats["pack_written"]
    again = load_model(path, cfg, torch.float32, "cpu", pack_dir=pack_dir)
    assert again.load_stats["source"] == "pack"
    for (name, a), (_, b) in zip(first.named_parameters(), again.named_parameters()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    return again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_fp8_checkpoint_on_the_gpu_matches_the_cpu_reference() -> None:
    """The FP8_DYNAMIC checkpoint served by the engine on the GPU in bf16 (FP8 kernels, CUDA
    graphs) against the same checkpoint on the CPU in float32: the prompt's most likely next
    tokens agree, and so do their log-probabilities."""
    from accuracy import engine_prompt_logprobs

    path = str(FIXTURES / "fp8-dynamic")
    cpu = torch.tensor(
        engine_prompt_logprobs(path, TOKS, max_model_len=256, dtype="float32", device="cpu")
    )
    gpu = torch.tensor(
        engine_prompt_logprobs(path, TOKS, max_model_len=256, dtype="bfloat16", device="cuda")
    )
    # bf16 activations on the GPU against float32 on the CPU: measured on an H200 (2026-11-26) the
    # log-probabilities (about -6) differ by 0.043 on average, 0.133 at most
    diff = (gpu - cpu).abs()
    assert diff.mean().item() < 0.08 and diff.max().item() < 0.25


def _hf_weight(model, name: str) -> torch.Tensor:
    """The float32 values a (rank's) model holds for the HF tensor `name` (its slice under tensor
    parallelism): the FP8 rows times their scales."""
    slot = model.hf_weight_map()[name]
    module = model.get_submodule(slot.param.removesuffix(".weight"))
    return (
        module.weight[slot.start : slot.end].float()
        * module.weight_scale[slot.start : slot.end, None]
    )


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8", "fp8-block", "hf-fp8"])
def test_each_rank_reads_its_slice_of_the_fp8_weights(name, hf_fp8_dir) -> None:
    """Under tensor parallelism each rank reads its slice of every FP8 weight with the matching
    scales: per-tensor and per-channel checkpoints give exactly the one-process values, cut; a
    block-scaled one, quantized again per channel on the slice, stays within e4m3's rounding."""
    path = hf_fp8_dir if name == "hf-fp8" else str(FIXTURES / name)
    cfg = ModelConfig.from_dir(path)
    whole = load_model(path, cfg, torch.float32, "cpu", load_format="safetensors")
    block = checkpoint_quantization(_config(path)).weight_scales == "block"
    for rank in range(2):
        part = load_model(
            path, cfg, torch.float32, "cpu", load_format="safetensors", shard=Shard(rank, 2)
        )
        for hf_name, slot in part.hf_weight_map().items():
            if not hf_name.endswith("proj.weight"):
                continue
            want = _hf_weight(whole, hf_name).narrow(slot.dim, slot.first, slot.count)
            have = _hf_weight(part, hf_name)
            if block:
                assert _relative(have, want) < 2**-4, (name, rank, hf_name)
            else:
                assert torch.equal(have, want), (name, rank, hf_name)


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-block"])
def test_fp8_checkpoints_serve_over_two_ranks(name, tmp_path) -> None:
    """Through the engine, TP=2 tracks one process: a row-parallel rank quantizes its own
    activation columns per token, so not bit for bit (measured: prompt logprobs of about -6 differ
    by 0.11 and 0.20 at most on these tiny random models)."""
    from engine import LLM, SamplingParams

    path = str(FIXTURES / name)
    kwargs = dict(
        dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, load_format="safetensors"
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    (ref,) = LLM(model=path, **kwargs).generate([{"prompt_token_ids": TOKS}], params)
    tp = LLM(model=path, tensor_parallel_size=2, **kwargs)
    try:
        (got,) = tp.generate([{"prompt_token_ids": TOKS}], params)
        assert tp.engine.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    finally:
        tp.shutdown()
    diffs = torch.tensor(
        [
            abs(x[t].logprob - y[t].logprob)
            for x, y, t in zip(ref.prompt_logprobs[1:], got.prompt_logprobs[1:], TOKS[1:])
        ]
    )
    assert diffs.max().item() < 0.3 and diffs.mean().item() < 0.1


def test_naming_a_checkpoint_format_as_the_scheme_says_it_is_read_from_the_checkpoint() -> None:
    """vLLM users pass --quantization compressed-tensors; here the checkpoint says so itself."""
    from engine import EngineArgs

    with pytest.raises(ValueError, match="read from the checkpoint's quantization_config"):
        EngineArgs(model="m", quantization="compressed-tensors").validate()


def test_static_activation_scales_are_said_to_be_unused(caplog) -> None:
    """A checkpoint's input_scale tensors are not used (activations are quantized per token): the
    load says so in one warning, and only for checkpoints that have them."""
    for name, says in (("fp8", True), ("fp8-dynamic", False)):
        caplog.clear()
        path = str(FIXTURES / name)
        with caplog.at_level("WARNING", logger="engine.models.weights"):
            load_model(
                path, ModelConfig.from_dir(path), torch.float32, "cpu", load_format="safetensors"
            )
        said = any("input_scale" in r.getMessage() for r in caplog.records)
        assert said == says, name
