"""Our decoder template against HF transformers on tiny random checkpoints of every supported
family.

Prefill then paged decode, mixed batches, sharded and old-spelling checkpoints, and the loader's
error messages.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention import kv_cache_shape
from engine.config import ModelConfig
from engine.models import DecoderModel, load_model
from tiny_models import (
    FAMILIES,
    PagedSeq,
    hf_logits,
    make_step,
    make_tiny_model,
    shuffled_block_tables,
)

BOUND = 1e-4  # max abs logit difference to HF in float32
BLOCK_SIZE = 4  # small, so that the 36-token runs cross many blocks
NUM_BLOCKS = 40
PROMPT_LEN = 20
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (checkpoint dir, HF model), built once per module."""
    built: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(family: str) -> tuple[str, torch.nn.Module]:
        if family not in built:
            path = str(tmp_path_factory.mktemp(family))
            built[family] = (path, make_tiny_model(family, path))
        return built[family]

    return get


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_cache(cfg: ModelConfig) -> torch.Tensor:
    return torch.zeros(
        kv_cache_shape(cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    )


def step_logits(
    model: DecoderModel, kv: torch.Tensor, seqs: list[PagedSeq], num_new: list[int]
) -> torch.Tensor:
    ids, positions, meta = make_step(seqs, num_new, BLOCK_SIZE)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, kv, meta))


def prefill_then_decode(model: DecoderModel, cfg: ModelConfig, toks: list[int]) -> torch.Tensor:
    """Logits of every position: one prefill of PROMPT_LEN tokens, then single-token decodes through
    the cache."""
    kv = new_cache(cfg)
    seq = PagedSeq(
        toks, shuffled_block_tables([len(toks)], BLOCK_SIZE, NUM_BLOCKS, seed=len(toks))[0]
    )
    out = [step_logits(model, kv, [seq], [PROMPT_LEN])]
    for _ in range(len(toks) - PROMPT_LEN):
        out.append(step_logits(model, kv, [seq], [1]))
    return torch.cat(out)


def load(path: str) -> tuple[DecoderModel, ModelConfig]:
    cfg = ModelConfig.from_dir(path)
    return load_model(path, cfg, torch.float32, "cpu"), cfg


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_decode_match_hf(tiny, family: str) -> None:
    path, hf = tiny(family)
    model, cfg = load(path)
    toks = tokens(PROMPT_LEN + DECODE_STEPS)
    # HF recomputes the whole sequence; causal, so row t is what a decode of token t must produce.
    ref = hf_logits(hf, toks)
    ours = prefill_then_decode(model, cfg, toks)
    assert ours.shape == ref.shape == (PROMPT_LEN + DECODE_STEPS, cfg.vocab_size)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() < BOUND


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen2-moe", "mixtral"])
def test_mixed_batch_matches_each_alone(tiny, family: str) -> None:
    """A chunked prefill after a cached prefix and a decode in one step give the same logits as
    apart."""
    path, hf = tiny(family)
    model, cfg = load(path)
    a_toks, b_toks = tokens(17, seed=1), tokens(14, seed=2)
    tables = shuffled_block_tables([17, 14], BLOCK_SIZE, NUM_BLOCKS, seed=3)
    a, b = PagedSeq(a_toks, tables[0]), PagedSeq(b_toks, tables[1])
    kv = new_cache(cfg)
    step_logits(model, kv, [a], [10])  # cached prefix of A
    step_logits(model, kv, [b], [13])  # B is prefilled, next comes its decode
    kv_apart = kv.clone()

    together = step_logits(model, kv, [a, b], [7, 1])
    a.num_cached, b.num_cached = 10, 13
    a_alone = step_logits(model, kv_apart, [a], [7])
    b_alone = step_logits(model, kv_apart, [b], [1])

    torch.testing.assert_close(together, torch.cat([a_alone, b_alone]), rtol=0, atol=1e-5)
    torch.testing.assert_close(kv, kv_apart, rtol=0, atol=1e-6)
    assert (together[:7] - hf_logits(hf, a_toks)[10:]).abs().max().item() < BOUND
    assert (together[7:] - hf_logits(hf, b_toks)[13:]).abs().max().item() < BOUND


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = make_tiny_model("qwen3", str(tmp_path), seed=5, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model, cfg = load(str(tmp_path))
    toks = tokens(PROMPT_LEN + 4, seed=5)
    assert (prefill_then_decode(model, cfg, toks) - hf_logits(hf, toks)).abs().max().item() < BOUND


@pytest.mark.parametrize("family", ["llama", "llama3-rope", "llama-linear-rope", "qwen2"])
def test_old_rope_spelling_loads_and_matches_hf(tmp_path: Path, family: str) -> None:
    new_dir, old_dir = tmp_path / "new", tmp_path / "old"
    hf = make_tiny_model(family, str(new_dir), seed=7)
    make_tiny_model(family, str(old_dir), seed=7, rope_spelling="old")
    old_cfg = json.loads((old_dir / "config.json").read_text())
    assert "rope_parameters" not in old_cfg and "rope_theta" in old_cfg
    assert ModelConfig.from_dir(str(old_dir)).rope == ModelConfig.from_dir(str(new_dir)).rope

    model, cfg = load(str(old_dir))
    toks = tokens(PROMPT_LEN + 6, seed=7)
    ref = hf_logits(hf, toks)
    assert (prefill_then_decode(model, cfg, toks) - ref).abs().max().item() < BOUND
    # The old spelling is genuine: transformers itself reads it back to the same model.
    from transformers import AutoModelForCausalLM

    hf_old = AutoModelForCausalLM.from_pretrained(str(old_dir), attn_implementation="eager").eval()
    assert (hf_logits(hf_old, toks) - ref).abs().max().item() < 1e-6


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dir(str(tmp_path))
    for arch in (
        "GPT2LMHeadModel",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ):
        assert arch in str(err.value)


def _edit_checkpoint(src: str, dest: Path, edit) -> str:
    shutil.copytree(src, dest)
    path = dest / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(dest)


def test_missing_tensor_is_named(tiny, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _edit_checkpoint(tiny("llama")[0], tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(
        ValueError,
        match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight \(1 in all\)",
    ):
        load(path)


def test_many_missing_tensors_are_counted(tiny, tmp_path: Path) -> None:
    def drop_layer_0(t: dict) -> None:
        for key in [k for k in t if k.startswith("model.layers.0.")]:
            t.pop(key)

    path = _edit_checkpoint(tiny("qwen2")[0], tmp_path / "ckpt", drop_layer_0)
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.0\..* \(12 in all\)"):
        load(path)


def test_unexpected_tensor_is_named(tiny, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.gate_proj.bias"
    path = _edit_checkpoint(
        tiny("llama")[0], tmp_path / "ckpt", lambda t: t.update({name: torch.zeros(128)})
    )
    with pytest.raises(
        ValueError, match=r"unexpected tensors.*model\.layers\.0\.mlp\.gate_proj\.bias"
    ):
        load(path)


def test_shape_mismatch_names_tensor_and_shapes(tiny, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    path = _edit_checkpoint(
        tiny("llama")[0], tmp_path / "ckpt", lambda t: t.update({name: torch.zeros(64, 96)})
    )
    with pytest.raises(
        ValueError,
        match=r"down_proj\.weight has shape \(64, 96\) but the model expects \(64, 128\)",
    ):
        load(path)


def test_ignorable_tensors_are_ignored(tiny, tmp_path: Path) -> None:
    """A tied checkpoint that still carries lm_head.weight, and rotary inv_freq buffers, load
    fine."""
    src, hf = tiny("qwen3-tied")

    def add_extras(t: dict) -> None:
        t["lm_head.weight"] = torch.zeros_like(t["model.embed_tokens.weight"])
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)

    model, cfg = load(_edit_checkpoint(src, tmp_path / "ckpt", add_extras))
    toks = tokens(PROMPT_LEN + 2, seed=9)
    assert (prefill_then_decode(model, cfg, toks) - hf_logits(hf, toks)).abs().max().item() < BOUND


def test_loads_in_bfloat16(tiny) -> None:
    path, hf = tiny("qwen3")
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    kv = new_cache(cfg).to(torch.bfloat16)
    seq = PagedSeq(
        tokens(PROMPT_LEN), shuffled_block_tables([PROMPT_LEN], BLOCK_SIZE, NUM_BLOCKS)[0]
    )
    ours = step_logits(model, kv, [seq], [PROMPT_LEN])
    ref = hf_logits(hf, seq.tokens)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() < 0.25  # bf16 carries ~3 significant digits
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "family", ["llama3-rope", "qwen2", "qwen3-tied", "phi3", "gemma3", "gemma2", "qwen2-window"]
)
def test_cuda_matches_hf(tiny, family: str) -> None:
    path, hf = tiny(family)
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, "cuda")
    assert all(p.device.type == "cuda" for p in model.parameters())
    toks = tokens(PROMPT_LEN + 4, seed=11)
    kv = new_cache(cfg).cuda()
    seq = PagedSeq(toks, shuffled_block_tables([len(toks)], BLOCK_SIZE, NUM_BLOCKS)[0])
    out = []
    for n in [PROMPT_LEN, 1, 1, 1, 1]:
        ids, positions, meta = make_step([seq], [n], BLOCK_SIZE, device="cuda")
        with torch.inference_mode():
            out.append(model.compute_logits(model(ids, positions, kv, meta)).cpu())
    assert (
        torch.cat(out) - hf_logits(hf, toks)
    ).abs().max().item() < 1e-3  # cuda kernels may reassociate
