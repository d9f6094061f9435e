"""Upper bounds, from the model's shapes alone, of the GPU memory one engine step takes beside
weights and KV cache.

They size the KV cache at start without a profiled step (tests/test_cold_start_gpu.py checks them
against one).
"""

from __future__ import annotations

from engine.config import ModelConfig

# cuBLAS workspaces, Triton launch buffers, the step's input staging and allocator rounding: a fixed
# allowance.
FIXED_SLACK_BYTES = 256 << 20
# The caching allocator keeps freed blocks for reuse; fragmentation can make a step reserve more
# than it uses.
FRAGMENTATION = 1.10
# Split-K decode attention keeps fp32 partial outputs per (token, head, split); the Triton backend
# caps splits here.
MAX_DECODE_SPLITS = 64


def layer_activation_bytes(cfg: ModelConfig, itemsize: int, num_tokens: int) -> int:
    """Tensors of one decoder layer alive at once for `num_tokens` tokens (earlier layers' are freed
    by then)."""
    q, kv, h, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    # qkv, rotated q and k, attention output, o_proj output
    attention_half = (q + 2 * kv) + (q + kv) + q + h
    mlp_half = 2 * inter + inter + h  # gate_up, silu(gate) * up, down_proj output
    stream = 3 * h  # the residual stream in and out, and its normed copy
    if cfg.hidden_act != "silu":  # the unfused GELU gate: its output and the product apart
        mlp_half += inter
    if cfg.gemma_norms:  # unfused (1 + w) norms: float32 copies of the stream
        stream += 3 * h * 4 // itemsize
    if cfg.gemma_norms or cfg.rotary_dim:  # rotation in torch: halves and their products
        attention_half += 2 * (q + kv)
    dense = num_tokens * (stream + max(attention_half, mlp_half)) * itemsize
    if cfg.moe is None:
        return dense
    return max(dense, num_tokens * stream * itemsize + moe_mlp_bytes(cfg, itemsize, num_tokens))


def moe_mlp_bytes(cfg: ModelConfig, itemsize: int, num_tokens: int) -> int:
    """A sparse MLP's tensors (engine/layers/fused_moe.py): router logits, weights and ids, the
    sort by expert (its torch path's int64 temporaries), the sorted rows' SiLU(gate) * up, each
    (token, expert) pair's output, their sum, and the shared expert's gate_up, product, output."""
    from engine.layers.fused_moe import MAX_BLOCK_M

    moe, h = cfg.moe, cfg.hidden_size
    pairs = num_tokens * moe.top_k
    rows = pairs + min(moe.num_experts, pairs) * (MAX_BLOCK_M - 1)
    router = num_tokens * moe.num_experts * itemsize + pairs * 8
    sort = pairs * 6 * 8 + rows * 4
    experts = rows * moe.expert_intermediate_size * itemsize + (pairs + num_tokens) * h * itemsize
    shared = num_tokens * (3 * moe.shared_expert_intermediate_size + 2 * h + 1) * itemsize
    return router + sort + experts + shared


def attention_scratch_bytes(
    cfg: ModelConfig, itemsize: int, num_tokens: int, num_seqs: int, backend: str
) -> int:
    """The attention backend's own temporaries: the torch reference materialises one sequence's
    scores (fp32 scores, their masked copy and softmax, the probabilities in the model dtype, the
    mask); Triton keeps only the split-K partials of a decode batch."""
    if backend == "torch":
        return (
            cfg.num_heads * num_tokens * num_tokens * (3 * 4 + itemsize) + num_tokens * num_tokens
        )
    return num_seqs * cfg.num_heads * MAX_DECODE_SPLITS * (cfg.head_dim + 1) * 4


def logits_bytes(cfg: ModelConfig, itemsize: int, num_rows: int) -> int:
    """Logits of `num_rows` rows in the model dtype and float32, and the sampler's working copies of
    them (top-k/p sort values and int64 order, softmax, cumulative sum, masks, the exponential
    draws): 8 float32 equivalents."""
    return num_rows * cfg.vocab_size * (itemsize + 4 + 8 * 4)


def step_peak_bytes(
    cfg: ModelConfig, itemsize: int, num_tokens: int, num_rows: int, backend: str
) -> int:
    """Bytes the largest step (num_tokens tokens, logits and sampling for num_rows rows) may add on
    the GPU."""
    activations = (
        layer_activation_bytes(cfg, itemsize, num_tokens) + num_tokens * cfg.hidden_size * itemsize
    )
    scratch = attention_scratch_bytes(cfg, itemsize, num_tokens, num_rows, backend)
    total = activations + scratch + logits_bytes(cfg, itemsize, num_rows)
    return int(total * FRAGMENTATION) + FIXED_SLACK_BYTES
