"""GGUF source: dequantize a .gguf checkpoint once into an HF-format directory (config, tokenizer,
safetensors).

The file is read with llama.cpp's own `gguf` package (GGUFReader, gguf.quants.dequantize), never
transformers: architectures llama, qwen2 and qwen3 with byte-level BPE vocabularies; anything else
is refused by name. `python -m cache.gguf FILE.gguf DEST` converts one file (the image bakes the
demo model this way).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# GGUF architecture -> the HF class the engine loads (llama.cpp writes Mistral checkpoints as
# "llama" too).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp's converter permutes the rows of Q and K for these architectures only (its rotary
# layout).
PERMUTED_QK = {"llama"}
# Where a byte-level BPE vocabulary splits text before the merges: tokenizer.ggml.pre -> the split
# regex of the model's own tokenizer.json (None: GPT-2's, which the ByteLevel pre-tokenizer applies
# itself).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "default": None,
    "gpt-2": None,
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
DTYPES = ("float32", "float16", "bfloat16")
SHARD_BYTES = 4 << 30  # one safetensors file holds at most this much (a shard is built in memory)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


class GGUFError(ValueError):
    """The GGUF file holds something this converter does not turn into an HF directory; says what
    and why."""


def read_metadata(reader) -> dict:
    """Every key-value field of the file (the GGUF.* header counts left out) as plain Python
    values."""
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def hf_config(meta: dict, tensor_names: set[str], dtype: str) -> dict:
    """config.json for the model the metadata describes: the keys transformers' GGUF loader reads,
    by llama.cpp's key names ({arch}.block_count, ...), plus the head size from the key length where
    the file states it."""
    arch = meta["general.architecture"]

    def key(name: str, default=None):
        return meta.get(f"{arch}.{name}", default)

    tokens = meta.get("tokenizer.ggml.tokens") or []
    heads = key("attention.head_count")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": key("vocab_size", len(tokens)),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "dtype": dtype,
    }
    head_dim = key("attention.key_length") or (
        key("rope.dimension_count") if arch in PERMUTED_QK else None
    )
    if head_dim:
        config["head_dim"] = head_dim
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
        ("unk_token_id", "unknown_token_id"),
    ):
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[hf_key] = meta[f"tokenizer.ggml.{gguf_key}"]
    missing = [k for k, v in config.items() if v is None]
    if missing:
        raise GGUFError(
            f"GGUF metadata lacks what config.json needs: {', '.join(missing)} (keys {arch}.*)"
        )
    return config


def hf_tensor_names(arch: str, num_layers: int, tied: bool) -> list[str]:
    """The parameters of the HF model the engine loads, in transformers' state-dict names."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + (
        [] if tied else ["lm_head.weight"]
    )
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if arch == "qwen2":
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if arch == "qwen3":
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return names + [f"model.layers.{i}.{p}" for i in range(num_layers) for p in per_layer]


def gguf_names(arch: str, hf_names: list[str], num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF name, through gguf's own TensorNameMap (the table llama.cpp converts
    with)."""
    import gguf

    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name_map = gguf.get_tensor_name_map(model_arch, num_layers)
    mapping = {}
    for hf_name in hf_names:
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            raise GGUFError(f"gguf {gguf.__version__} has no GGUF name for {hf_name} ({arch})")
        mapping[f"{gguf_name}.{suffix}"] = hf_name
    return mapping


def unpermute_qk(rows, n_head: int):
    """Undo llama.cpp's Q/K row permutation (it interleaves the two rotary halves of each head), as
    transformers' GGUF loader does: rows are grouped [head, pair, half] in the file and [head, half,
    pair] in HF."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _byte_level_spelling():
    """token -> the token spelled in the byte-level alphabet (GPT-2's byte-to-unicode table, via
    tokenizers)."""
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return lambda token: (
        token if set(token) <= alphabet else "".join(p for p, _ in spell.pre_tokenize_str(token))
    )


def build_tokenizer(meta: dict):
    """The tokenizers.Tokenizer a byte-level BPE GGUF vocabulary describes: vocabulary and merges as
    the file lists them, control tokens as special tokens, user-defined ones as added tokens, and
    the model's split regex."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFError(
            f"tokenizer.ggml.model {kind!r}: only byte-level BPE vocabularies ('gpt2') are "
            "converted; serve the model's HF repository instead of its GGUF file"
        )
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(
            f"tokenizer.ggml.pre {pre!r}: no known split regex; known are "
            f"{', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    spell = _byte_level_spelling()
    tokens = [spell(t) for t in meta["tokenizer.ggml.tokens"]]
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    original = meta["tokenizer.ggml.tokens"]
    # A control token outside the byte alphabet is a mislabel in the file: adding it would grow the
    # vocabulary.
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind_id, raw in zip(tokens, types, original)
            if kind_id == _CONTROL and t == raw
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind_id in zip(tokens, types)
            if kind_id == _USER_DEFINED
        ]
    )
    tok.post_processor = _post_processor(meta, tokens, processors)
    return tok


def _post_processor(meta: dict, tokens: list[str], processors):
    """BOS/EOS added to an encoded text as the file's add_bos_token / add_eos_token flags say."""
    edges = {}
    for side, flag, id_key in (
        ("bos", "add_bos_token", "bos_token_id"),
        ("eos", "add_eos_token", "eos_token_id"),
    ):
        token_id = meta.get(f"tokenizer.ggml.{id_key}")
        if meta.get(f"tokenizer.ggml.{flag}", False) and token_id is not None:
            edges[side] = (tokens[token_id], token_id)
    bos, eos = edges.get("bos"), edges.get("eos")

    def template(seq: str, type_id: int) -> str:
        parts = (
            ([f"{bos[0]}:{type_id}"] if bos else [])
            + [f"${seq}:{type_id}"]
            + ([f"{eos[0]}:{type_id}"] if eos else [])
        )
        return " ".join(parts)

    return processors.TemplateProcessing(
        single=template("A", 0),
        pair=f"{template('A', 0)} {template('B', 1)}",
        special_tokens=list(edges.values()),
    )


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: the named special tokens and the BOS/EOS flags (the chat template goes
    beside it)."""
    tokens = meta["tokenizer.ggml.tokens"]
    config = {
        "tokenizer_class": "TokenizersBackend",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    for name, key in _SPECIAL_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[name] = tokens[token_id]
    return config


def _cast(weights, dtype: str):
    """float32 dequantized values -> the output dtype: numpy for float32/float16, torch for
    bfloat16."""
    import numpy as np

    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)).to(torch.bfloat16)
    return np.ascontiguousarray(weights, dtype=np.dtype(dtype))


def _save(tensors: dict, path: Path, dtype: str) -> None:
    metadata = {"format": "pt"}
    if dtype == "bfloat16":
        from safetensors.torch import save_file
    else:
        from safetensors.numpy import save_file
    save_file(tensors, str(path), metadata=metadata)


def write_tensors(reader, meta: dict, config: dict, out: Path, dtype: str) -> None:
    """Dequantize every tensor into safetensors under out (model.safetensors, or shards and their
    index), each GGUF tensor mapped to its HF name; a tensor with no HF counterpart, or one missing,
    is refused."""
    from gguf.quants import dequantize

    arch = meta["general.architecture"]
    hf_names = hf_tensor_names(arch, config["num_hidden_layers"], config["tie_word_embeddings"])
    mapping = gguf_names(arch, hf_names, config["num_hidden_layers"])
    found = {t.name for t in reader.tensors}
    unknown = sorted(found - mapping.keys())
    if unknown:
        raise GGUFError(
            f"GGUF tensors with no counterpart in {ARCHITECTURES[arch]}: {', '.join(unknown[:5])}"
        )
    missing = sorted(set(mapping) - found)
    if missing:
        raise GGUFError(
            f"GGUF file lacks tensors {ARCHITECTURES[arch]} needs: {', '.join(missing[:5])}"
        )
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    shards: list[dict] = [{}]
    size = 0
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        kind = tensor.name.split(".")[-2]
        if arch in PERMUTED_QK and kind in heads and tensor.name.endswith(".weight"):
            weights = unpermute_qk(weights, heads[kind])
        value = _cast(weights, dtype)
        nbytes = value.nbytes if hasattr(value, "nbytes") else value.numel() * value.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][mapping[tensor.name]] = value
        size += nbytes
    if len(shards) == 1:
        _save(shards[0], out / "model.safetensors", dtype)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, out / name, dtype)
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )


def write_hf_dir(gguf_path: str, out_dir: str | os.PathLike, dtype: str = "float32") -> None:
    """Dequantize gguf_path into the existing directory out_dir: safetensors, config.json, tokenizer
    files."""
    from gguf import GGUFReader

    if dtype not in DTYPES:
        raise GGUFError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; supported are "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    config = hf_config(meta, {t.name for t in reader.tensors}, dtype)
    # before the weights: a refused vocabulary costs no dequantizing
    tokenizer = build_tokenizer(meta)
    write_tensors(reader, meta, config, out, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2))
    if meta.get("tokenizer.chat_template"):
        (out / "chat_template.jinja").write_text(meta["tokenizer.chat_template"], encoding="utf-8")


def convert_gguf(gguf_path: str, dest: str, dtype: str = "float32") -> str:
    """Write gguf_path as an HF-format model directory at dest; a complete dest is reused as is."""
    dest_path = Path(dest)
    if (dest_path / "config.json").exists():
        return str(dest_path)
    dest_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest_path.parent, prefix=".tmp-gguf-"))
    try:
        write_hf_dir(gguf_path, tmp, dtype)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, dest_path)
        except OSError:  # another process published it first
            if not (dest_path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest_path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m cache.gguf", description=__doc__.splitlines()[0]
    )
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument(
        "dest", help="the HF-format directory to write (kept as is if already complete)"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args(argv)
    try:
        print(convert_gguf(args.gguf, args.dest, args.dtype))
    except (GGUFError, OSError) as exc:
        print(f"python -m cache.gguf: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
