"""bench.layer_shapes on real architectures' config.json files (bench/configs): the linears the
benchmarks time per layer, and the parameters a token multiplies (a mixture of experts counts the
experts it selects, not all of them)."""

from __future__ import annotations

import json

from bench.checkpoint import CONFIGS
from bench.layer_shapes import active_linear_params, layer_linears
from engine.config import ModelConfig


def _config(name: str) -> tuple[dict, ModelConfig]:
    raw = json.loads((CONFIGS / name).read_text())
    return raw, ModelConfig.from_dict(raw)


def test_a_dense_model_multiplies_every_linear_of_every_layer():
    raw, cfg = _config("llama-3.1-8b.json")
    shapes = {name: (n, k) for name, n, k in layer_linears(cfg)}
    assert shapes == {
        "qkv": (6144, 4096),
        "o_proj": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    }
    per_layer = sum(n * k for n, k in shapes.values())
    assert active_linear_params(cfg) == per_layer * raw["num_hidden_layers"]
    # Llama-3.1-8B: about 6.98 billion parameters in its decoder layers' linears
    assert 6.9e9 < active_linear_params(cfg) < 7.0e9


def test_a_mixture_of_experts_counts_the_experts_a_token_selects():
    raw, cfg = _config("qwen3-30b-a3b.json")
    h, layers = raw["hidden_size"], raw["num_hidden_layers"]
    attention = (raw["num_attention_heads"] + 2 * raw["num_key_value_heads"]) * raw["head_dim"] * h
    attention += h * raw["num_attention_heads"] * raw["head_dim"]
    experts = raw["num_experts_per_tok"] * 3 * raw["moe_intermediate_size"] * h
    router = raw["num_experts"] * h
    assert active_linear_params(cfg) == layers * (attention + experts + router)
    # "A3B": about 3 billion active parameters with the embeddings and lm_head
    assert 2.5e9 < active_linear_params(cfg) + 2 * h * raw["vocab_size"] < 3.5e9
    assert [name for name, _, _ in layer_linears(cfg)] == ["qkv", "o_proj", "router"]
