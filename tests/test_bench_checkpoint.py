"""The benchmark checkpoints carry exactly the tensors transformers expects for each real
architecture."""

from __future__ import annotations

import json
import re

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
