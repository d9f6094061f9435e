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
    assert set(ours) == set(reference) - {
        "lm_head.weight"
    }  # tied: the embedding is the output projection
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
