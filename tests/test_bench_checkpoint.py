"""The benchmark checkpoints carry exactly the tensors transformers expects for each real
architecture; a packed synthesis (sparse shards and the pack) starts from its pack."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from bench.checkpoint import CONFIGS, hf_tensor_shapes


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_tensor_names_and_shapes_match_transformers(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((CONFIGS / name).read_text())
    # a multimodal checkpoint (Gemma 3): the engine serves its text decoder, the tensors
    # transformers' text-only model of it carries
    hf_config = config.get("text_config", config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config))
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if getattr(hf.config.get_text_config(), "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    assert _as_fused_experts(hf_tensor_shapes(config)) == expected


_GATE_UP = ("gate_proj", "up_proj", "w1", "w3")
_EXPERT = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def _as_fused_experts(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """Checkpoint names (per-expert tensors, Mixtral's block_sparse_moe) as transformers 5 holds
    them in memory: each layer's experts stacked into mlp.experts.gate_up_proj [E, 2I, H] and
    mlp.experts.down_proj [E, H, I]."""
    out: dict[str, tuple] = {}
    stacked: dict[str, list] = {}
    for name, shape in shapes.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = shape
            continue
        layer, expert, part = m.group(1), int(m.group(2)), m.group(3)
        kind = "gate_up_proj" if part in _GATE_UP else "down_proj"
        stacked.setdefault(f"{layer}.mlp.experts.{kind}", []).append((expert, shape))
    for name, parts in stacked.items():
        experts = {e for e, _ in parts}
        rows = sum(shape[0] for _, shape in parts) // len(experts)
        out[name] = (len(experts), rows, parts[0][1][1])
    return out


def test_a_packed_synthesis_keeps_only_the_packs_bytes_and_a_start_loads_that_pack(tmp_path):
    """bench.checkpoint.synthesize_packed (a Qwen3-MoE config, shrunk): the shards are valid
    safetensors of the architecture's tensors, all zeros, holding almost no disk blocks; the pack
    beside them is what the engine's load takes (keyed to those files), with the weights the dummy
    fill makes."""
    from safetensors import safe_open

    from bench.checkpoint import synthesize_packed
    from engine.config import ModelConfig
    from engine.models.weights import load_model

    config = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    config.update(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=32000,
        max_window_layers=2,
    )
    model_dir = synthesize_packed(config, str(tmp_path / "moe"), shard_bytes=3 << 20, device="cpu")
    shards = sorted(Path(model_dir).glob("*.safetensors"))
    assert len(shards) >= 2
    seen = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert t.dtype == torch.bfloat16 and not t.any(), name
                seen[name] = tuple(t.shape)
        size = shard.stat().st_size
        if size > 1 << 20:  # a hole where the data would be
            assert shard.stat().st_blocks * 512 < size // 4, shard
    assert seen == hf_tensor_shapes(config)
    cfg = ModelConfig.from_dict(config)
    packed = load_model(model_dir, cfg, "auto", "cpu")
    assert packed.load_stats["source"] == "pack", packed.load_stats
    packed.wait_weights()
    dummy = load_model(model_dir, cfg, "auto", "cpu", load_format="dummy")
    for (name, a), (_, b) in zip(packed.named_parameters(), dummy.named_parameters()):
        assert torch.equal(a, b), name
