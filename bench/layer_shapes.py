"""The linears of a model's decoder layers as the benchmarks size them: each layer's (name, N, K)
for timing GEMMs, and the parameters of them one token multiplies, for FLOP counts."""

from __future__ import annotations

from engine.config import ModelConfig


def _attention_linears(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    hidden, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    return [("qkv", q + 2 * cfg.num_kv_heads * cfg.head_dim, hidden), ("o_proj", hidden, q)]


def _dense_mlp_linears(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return [("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def layer_linears(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of a decoder layer's linears: qkv and o_proj, then the MLP's gate_up and
    down, or a mixture of experts' router (its experts are engine/layers/fused_moe*.py's)."""
    if cfg.moe is not None:
        return _attention_linears(cfg) + [("router", cfg.moe.num_experts, cfg.hidden_size)]
    return _attention_linears(cfg) + _dense_mlp_linears(cfg)


def active_linear_params(cfg: ModelConfig) -> int:
    """Parameters of the decoder layers' linears that one token multiplies: attention's and the
    dense MLP's; in a mixture of experts' sparse layers the router, the top_k experts the token
    selects and the shared expert with its gate."""
    hidden = cfg.hidden_size
    attention = sum(n * k for _, n, k in _attention_linears(cfg))
    dense_mlp = sum(n * k for _, n, k in _dense_mlp_linears(cfg))
    moe = cfg.moe
    total = 0
    for layer in range(cfg.num_layers):
        total += attention
        if moe is None or not moe.is_sparse(layer):
            total += dense_mlp
            continue
        total += moe.num_experts * hidden + moe.top_k * 3 * moe.expert_intermediate_size * hidden
        if moe.shared_expert_intermediate_size:
            total += 3 * moe.shared_expert_intermediate_size * hidden + hidden
    return total
