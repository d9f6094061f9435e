"""Tiny random-weight HF checkpoints of every supported family, and hand-built AttentionMetadata,
for the tests.

The HF models come from transformers (a test-only dependency) and are saved with save_pretrained, as
a hub repo is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata

# family -> (HF architecture, config overrides). All: hidden 64, 4 heads, vocab 256, float32.
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": (
        "LlamaForCausalLM",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
    "llama3-rope": (
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=3,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # Small, so that the tiny head_dim has frequencies in all three bands.
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-linear-rope": (
        "LlamaForCausalLM",
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}),
    ),
    "llama-tied": (
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        ),
    ),
    # MQA (1 kv head) and a sliding window shorter than the test sequences.
    "mistral": (
        "MistralForCausalLM",
        dict(
            num_key_value_heads=1,
            sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # MHA with q/k/v biases.
    "qwen2": (
        "Qwen2ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # Explicit head_dim (32) different from hidden / heads (16), per-head q/k norm.
    "qwen3": (
        "Qwen3ForCausalLM",
        dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    "qwen3-tied": (
        "Qwen3ForCausalLM",
        dict(
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # Mixture of experts: top-2 of 8 renormalised, a dense MLP in the middle (mlp_only_layers).
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # top-8 of 16 not renormalised, experts on every second layer (decoder_sparse_step 2).
    "qwen3-moe-top8": (
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=4,
            num_experts=16,
            num_experts_per_tok=8,
            moe_intermediate_size=16,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # top-1 (its softmax weight, not 1) plus the sigmoid-gated shared expert; q/k/v biases.
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # top-2 of 4 renormalised, experts as wide as intermediate_size, MQA.
    "mixtral": (
        "MixtralForCausalLM",
        dict(
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # Qwen's per-layer windows: layers from max_window_layers on are windowed (window 8).
    "qwen2-window": (
        "Qwen2ForCausalLM",
        dict(
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # Phi-3 past the longrope switch (every test sequence is longer than 16 tokens: the long
    # factors, as HF takes them), half the head rotated, fused qkv / gate_up in the checkpoint.
    "phi3": (
        "Phi3ForCausalLM",
        dict(
            num_hidden_layers=3,
            original_max_position_embeddings=16,
            partial_rotary_factor=0.5,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 1.9, 2.6],
                "long_factor": [1.0, 2.5, 4.0, 9.0],
            },
            pad_token_id=0,
        ),
    ),
    # Gemma 3: local (window 8, theta 10k) and global (linear rope, theta 1M) layers, two of each
    # kind, head_dim 32 (not hidden / heads), query_pre_attn_scalar 24, tied embeddings.
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            pad_token_id=0,
        ),
    ),
    # Gemma 2: alternating local (window 8) and global layers, soft-capped attention scores and
    # logits (caps small enough to bite on these weights), no q/k norm.
    "gemma2": (
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            pad_token_id=0,
        ),
    ),
}
# HF architecture -> its config class, where the name does not follow from the architecture's
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def hf_config(family: str, **extra):
    """The HF config of `family`; `extra` overrides its fields (e.g. attention_bias=True)."""
    import transformers

    arch, overrides = FAMILIES[family]
    config_name = _CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, config_name)
    cfg = config_cls(**{**_COMMON, **overrides, **extra})
    cfg._attn_implementation = "eager"
    return cfg


def make_tiny_model(
    family: str,
    out_dir: str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    rope_spelling: str = "new",
    **config,
):
    """Build a seeded random HF model of `family`, save it to `out_dir` and return it (eval,
    float32).

    rope_spelling "old" rewrites config.json with `rope_theta` + `rope_scaling` instead of
    `rope_parameters`. `config` overrides fields of the family's config.
    """
    import transformers

    arch, _ = FAMILIES[family]
    cfg = hf_config(family, **config)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float().eval()
    _randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    if rope_spelling == "old":
        write_old_rope_spelling(out_dir)
    elif rope_spelling != "new":
        raise ValueError(f"rope_spelling: 'new' or 'old', got {rope_spelling!r}")
    return model


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights: norms around 1 with noise, matrices N(0, 0.05), embeddings N(0, 0.1),
    biases N(0, 0.1). Gemma stores its norms as offsets from 1: around 0 there."""
    gen = torch.Generator().manual_seed(seed + 1)
    norm_center = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(norm_center + 0.2 * noise)
        elif name.endswith("bias") or "embed_tokens" in name or "lm_head" in name:
            p.copy_(0.1 * noise)
        else:
            p.copy_(0.05 * noise)


def add_char_tokenizer(model_dir: str) -> None:
    """Give a tiny model (vocab 256) a one-character-per-token tokenizer:
    id i >= 3 <-> chr(0x100 + i)."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(0x100 + i): i for i in range(3, 256)}}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)


def write_old_rope_spelling(model_dir: str) -> None:
    """Rewrite config.json's `rope_parameters` as the older spelling, `rope_theta` and
    `rope_scaling` (before transformers 5)."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type", "default")
    if rope_type == "default":
        cfg["rope_scaling"] = None
    elif rope_type == "linear":
        cfg["rope_scaling"] = {"type": "linear", **params}  # the oldest spelling used "type"
    else:
        cfg["rope_scaling"] = {"rope_type": rope_type, **params}
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Full-recompute logits [len(tokens), vocab] float32 of an HF model (causal: row t sees
    tokens[: t + 1])."""
    return model(torch.tensor([tokens]), use_cache=False).logits[0].float()


# --- paged KV bookkeeping, by hand ----------------------------------------------------------------


@dataclass
class PagedSeq:
    """One sequence's tokens, how many of them are in the KV cache, and its block table."""

    tokens: list[int]
    block_table: list[int]
    num_cached: int = 0


def shuffled_block_tables(
    lengths: list[int], block_size: int, num_blocks: int, seed: int = 0
) -> list[list[int]]:
    """Disjoint, non-contiguous block tables (random block ids) big enough for each length."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for n in lengths:
        need = (n + block_size - 1) // block_size
        if at + need > num_blocks:
            raise ValueError("shuffled_block_tables: not enough blocks")
        tables.append(perm[at : at + need])
        at += need
    return tables


def make_step(
    seqs: list[PagedSeq], num_new: list[int], block_size: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids, positions and AttentionMetadata for one step where seqs[i] adds its next
    num_new[i] tokens.

    Advances each sequence's num_cached.
    """
    ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
    for seq, n in zip(seqs, num_new):
        start = seq.num_cached
        for p in range(start, start + n):
            ids.append(seq.tokens[p])
            positions.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        query_start.append(query_start[-1] + n)
        seq_lens.append(start + n)
        seq.num_cached = start + n
    meta = host_metadata(
        slots, query_start, seq_lens, [s.block_table for s in seqs], block_size, device
    )
    as_long = dict(dtype=torch.int64, device=device)
    return torch.tensor(ids, **as_long), torch.tensor(positions, **as_long), meta


def host_metadata(
    slots: list[int],
    query_start: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    block_size: int,
    device: str | torch.device = "cpu",
) -> AttentionMetadata:
    """AttentionMetadata from host lists: block tables padded with block 0 to the widest (at least
    one column); the leading one-token sequences counted as the stager counts them."""
    width = max(max(len(t) for t in tables), 1)
    query_lens = [b - a for a, b in zip(query_start, query_start[1:])]
    leading = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
        num_decode_seqs=leading,
    )
