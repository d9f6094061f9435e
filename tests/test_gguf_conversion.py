"""cache.gguf (the gguf package alone) against transformers' own GGUF loader on the embedded demo's
file.

Every tensor bit for bit, the tokenizer's serialization, its special tokens and chat template, and
the config as transformers reads it back; files the converter does not handle are refused by name
before any weight is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cache.gguf import GGUFError, convert_gguf, unpermute_qk, write_hf_dir
from conftest import REPO, SMOLLM2_GGUF, _gguf_dir

# transformers writes these config keys for bookkeeping: where it loaded from and its own version.
BOOKKEEPING = {"_name_or_path", "_model_name_or_path", "transformers_version", "dtype"}


@pytest.fixture(scope="module")
def transformers_reference():
    """The demo GGUF loaded by transformers (model in float32 and tokenizer), as transformers itself
    converts it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        _gguf_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    return model, AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=SMOLLM2_GGUF)


@pytest.mark.slow
def test_every_tensor_equals_transformers_conversion(smollm2_dir, transformers_reference):
    from safetensors.torch import load_file

    model, _ = transformers_reference
    ours = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    reference = model.state_dict()
    assert model.config.tie_word_embeddings
    # tied: the embedding is the output projection
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in reference.items():
        mine = ours.get(
            name, ours["model.embed_tokens.weight"] if name == "lm_head.weight" else None
        )
        assert mine.dtype == tensor.dtype and torch.equal(mine, tensor), name


@pytest.mark.slow
def test_config_reads_back_as_transformers_conversion(smollm2_dir, transformers_reference):
    from transformers import AutoConfig

    model, _ = transformers_reference
    ours = AutoConfig.from_pretrained(smollm2_dir).to_dict()
    reference = model.config.to_dict()
    for key in BOOKKEEPING:
        ours.pop(key, None)
        reference.pop(key, None)
    # What transformers leaves open on a GGUF load: the class (it knows the one it built) and the
    # packed weights' quantization, which a dequantized directory no longer has.
    assert reference.pop("architectures") is None and ours.pop("architectures") == [
        type(model).__name__
    ]
    assert reference.pop("quantization_config")["quant_method"] == "gguf"
    assert ours == reference


@pytest.mark.slow
def test_tokenizer_equals_transformers_conversion(smollm2_dir, transformers_reference):
    from transformers import AutoTokenizer

    _, reference = transformers_reference
    with open(os.path.join(smollm2_dir, "tokenizer.json"), encoding="utf-8") as f:
        assert json.load(f) == json.loads(reference.backend_tokenizer.to_str())
    ours = AutoTokenizer.from_pretrained(smollm2_dir)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert ours.chat_template == reference.chat_template
    texts = [
        "Hello world",
        "  two spaces\nand a line",
        "<|im_start|>user\nHi<|im_end|>",
        "café 123456 naïve",
    ]
    for text in texts:
        assert ours(text)["input_ids"] == reference(text)["input_ids"], text
    conversation = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    ) == reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's convert_hf_to_gguf permutes each head's rows to [pair, half]; the inverse
    restores HF rows."""
    n_head, head_dim, cols = 3, 8, 5
    hf_rows = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    # The forward permutation as llama.cpp's converter writes it (reshape to [head, 2, half], swap,
    # flatten).
    in_file = hf_rows.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf_rows.shape)
    assert not np.array_equal(in_file, hf_rows)
    assert np.array_equal(unpermute_qk(in_file, n_head), hf_rows)


def test_conversion_imports_no_transformers(tmp_path):
    """The demo converts in a process that never imports transformers (nor torch for float32)."""
    code = (
        "import sys, os; from cache.gguf import convert_gguf; "
        f"convert_gguf({os.path.join(_gguf_dir(), SMOLLM2_GGUF)!r}, {str(tmp_path / 'out')!r}); "
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _gguf_with(tmp_path, **fields) -> str:
    """A tiny GGUF written by gguf's own GGUFWriter: the given metadata and one tensor."""
    import gguf

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, fields.pop("arch", "llama"))
    for key, value in fields.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A one-layer llama's metadata, for files that get past the architecture check.
_LLAMA_SHAPE = {
    "llama.block_count": 1,
    "llama.embedding_length": 8,
    "llama.feed_forward_length": 16,
    "llama.attention.head_count": 2,
    "llama.context_length": 64,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"arch": "gemma3"}, "GGUF architecture 'gemma3' is not supported"),
        (
            _LLAMA_SHAPE
            | {
                "tokenizer.ggml.model": "llama",
                "tokenizer.ggml.tokens": ["<unk>", "a", "b", "c"],
            },
            "tokenizer.ggml.model 'llama': only byte-level BPE",
        ),
        (
            _LLAMA_SHAPE
            | {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "tekken",
                "tokenizer.ggml.tokens": ["a", "b", "c", "d"],
            },
            "tokenizer.ggml.pre 'tekken'",
        ),
        (
            _LLAMA_SHAPE
            | {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.tokens": ["a", "b", "c", "d"],
            },
            "GGUF file lacks tensors LlamaForCausalLM needs",
        ),
    ],
)
def test_unsupported_files_are_refused_by_name(tmp_path, fields, message):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(GGUFError, match=message):
        write_hf_dir(_gguf_with(tmp_path, **fields), out)
    assert not any(out.iterdir())


def test_cli_converts_and_reports_errors(tmp_path):
    bad = _gguf_with(tmp_path, arch="gemma3")
    out = subprocess.run(
        [sys.executable, "-m", "cache.gguf", bad, str(tmp_path / "x")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "GGUF architecture 'gemma3' is not supported" in out.stderr
    assert not (tmp_path / "x").exists()
    dest = convert_gguf(os.path.join(_gguf_dir(), SMOLLM2_GGUF), str(tmp_path / "demo"))
    again = subprocess.run(
        [sys.executable, "-m", "cache.gguf", os.path.join(_gguf_dir(), SMOLLM2_GGUF), dest],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert again.stdout.strip() == dest  # a complete directory is kept as is


def _tiny_gguf(path: Path, arch: str, pre: str, add_bos: bool) -> dict[str, np.ndarray]:
    """A two-layer model of `arch` with random weights in HF layout, written by gguf's GGUFWriter as
    llama.cpp's converter writes one (Q/K rows permuted for llama), with the demo's vocabulary and
    merges under the pre-tokenizer `pre`; returns the HF tensors it holds."""
    import gguf

    source = gguf.GGUFReader(os.path.join(_gguf_dir(), SMOLLM2_GGUF))
    meta = {k: f.contents() for k, f in source.fields.items() if k.startswith("tokenizer.ggml.")}
    vocab, hidden, heads, kv_heads, ffn, layers = (
        len(meta["tokenizer.ggml.tokens"]),
        16,
        2,
        1,
        32,
        2,
    )
    # Qwen3's heads are wider than hidden / heads; 128 is what transformers assumes, since its GGUF
    # loader reads no head size for qwen3 (llama.cpp writes it as attention.key_length).
    head_dim = 128 if arch == "qwen3" else hidden // heads
    rng = np.random.default_rng(0)
    hf = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        hf |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if arch == "qwen2":
            hf |= {
                p + f"self_attn.{x}_proj.bias": (n * head_dim,)
                for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))
            }
        if arch == "qwen3":
            hf |= {
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
            }
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in hf.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers
    )
    for name, value in tensors.items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if (
            arch == "llama"
            and suffix == "weight"
            and gguf_name.split(".")[-2] in ("attn_q", "attn_k")
        ):
            n = heads if "attn_q" in gguf_name else kv_heads  # llama.cpp's permutation, forwards
            value = value.reshape(n, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(value.shape)
        writer.add_tensor(gguf_name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "pre", "add_bos"),
    [("llama", "llama-bpe", True), ("qwen2", "qwen2", False), ("qwen3", "qwen2", False)],
)
def test_other_architectures_and_splits_match_transformers(
    tmp_path, monkeypatch, arch, pre, add_bos
):
    """Untied output, Qwen2's biases, Qwen3's q/k norms, Llama 3's and Qwen2's split regexes and a
    BOS added by the post-processor, each against transformers' conversion of the same file; shards
    and their index when the weights pass SHARD_BYTES."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import cache.gguf

    path = tmp_path / f"tiny-{arch}.gguf"
    original = _tiny_gguf(path, arch, pre, add_bos)
    monkeypatch.setattr(cache.gguf, "SHARD_BYTES", 2 << 20)  # the embeddings alone are 3 MB
    ours = Path(convert_gguf(str(path), str(tmp_path / "ours")))
    index = json.loads((ours / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and set(index) == set(original)
    tensors = {}
    for shard in sorted(set(index.values())):
        tensors |= load_file(str(ours / shard))
    assert set(tensors) == set(original)
    for name, value in original.items():
        assert np.array_equal(tensors[name], value), name  # the permutation undone exactly
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    for name, value in model.state_dict().items():
        assert torch.equal(torch.from_numpy(tensors[name]), value), name
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    with open(ours / "tokenizer.json", encoding="utf-8") as f:
        assert json.load(f) == json.loads(reference.backend_tokenizer.to_str())
    mine = AutoTokenizer.from_pretrained(str(ours))
    for text in ["Hello world", "It's 2026: 12345 apples\n\n  indented", "<|im_start|>x"]:
        assert mine(text)["input_ids"] == reference(text)["input_ids"], text
    assert mine("Hi")["input_ids"][0] == (1 if add_bos else mine("Hi")["input_ids"][0])
