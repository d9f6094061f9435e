"""Compiled-engine artifacts: the key, the choice ENGINE_MODE makes, and installing an artifact's
kernels.

CPU: keys built for machines this is not (pure functions), artifacts written as a build writes them.
GPU (-m gpu): `python -m warmup build` on a small model, then the compiled engine against jit
(identical greedy tokens).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_gpu_memory
from warmup.artifacts import (
    ARTIFACT_FILE,
    TRITON_DIR,
    ArtifactError,
    artifact_key,
    artifact_roots,
    gpuless_key,
    install,
    kernel_code_digest,
    key_id,
    mismatches,
    prepare,
    select,
)

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("gpu_memory_back")
LIMITS = {
    "dtype": "bfloat16",
    "max_model_len": 4096,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "block_size": 16,
    "gpu_memory_utilization": 0.9,
}
H100 = {"gpu_arch": "sm_90", "gpu_memory_gib": 80}
STACK = {"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "kernel_code": "0123abcd"}


def _key(**changes) -> dict:
    parts = {"device": dict(H100), "software": dict(STACK), "limits": dict(LIMITS)}
    for name, value in changes.items():
        for part in parts.values():
            if name in part:
                part[name] = value
    return artifact_key(
        changes.get("model_digest", "abc123"), parts["limits"], parts["device"], parts["software"]
    )


def _write_artifact(root: Path, key: dict, kernels: dict[str, bytes] | None = None) -> Path:
    d = root / key_id(key)
    (d / TRITON_DIR).mkdir(parents=True)
    for name, data in (kernels or {}).items():
        (d / TRITON_DIR / name).parent.mkdir(parents=True, exist_ok=True)
        (d / TRITON_DIR / name).write_bytes(data)
    record = {"kv_step_bytes": 123456789, "num_kv_blocks": 1000, "graph_sizes": [1, 2, 4, 8]}
    (d / ARTIFACT_FILE).write_text(json.dumps({"key": key, "record": record}))
    return d


def test_the_key_names_every_field_and_changes_with_each():
    key = _key()
    assert list(key) == [
        "format",
        "model_digest",
        "gpu_arch",
        "gpu_memory_gib",
        "torch",
        "triton",
        "cuda",
        "kernel_code",
        "dtype",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "gpu_memory_utilization",
    ]
    assert key_id(_key()) == key_id(key)
    for change in (
        {"gpu_arch": "sm_80"},
        {"gpu_memory_gib": 40},
        {"torch": "2.12.0"},
        {"triton": "3.7.0"},
        {"cuda": "12.8"},
        {"kernel_code": "4567cdef"},
        {"dtype": "float16"},
        {"max_model_len": 8192},
        {"max_num_seqs": 64},
        {"block_size": 32},
        {"gpu_memory_utilization": 0.8},
        {"model_digest": "def456"},
    ):
        assert key_id(_key(**change)) != key_id(key), change
    # an FP8 KV cache (other kernels, other sizing) is in the key; the default is left out, so keys
    # written before the field existed keep their ids
    assert artifact_key("abc123", {**LIMITS, "kv_cache_dtype": "auto"}, H100, STACK) == key
    fp8 = artifact_key("abc123", {**LIMITS, "kv_cache_dtype": "fp8_e4m3"}, H100, STACK)
    assert fp8["kv_cache_dtype"] == "fp8_e4m3" and key_id(fp8) != key_id(key)
    assert mismatches(fp8, key) == ["kv_cache_dtype (built for 'fp8_e4m3', this worker 'auto')"]
    # so are FP8 weights: a worker quantizing the same checkpoint takes no bf16 engine (its linears'
    # kernels, and a KV sizing measured beside twice the weight bytes), nor the reverse
    assert artifact_key("abc123", {**LIMITS, "quantization": None}, H100, STACK) == key
    w8 = artifact_key("abc123", {**LIMITS, "quantization": "fp8"}, H100, STACK)
    assert w8["quantization"] == "fp8" and key_id(w8) != key_id(key)
    assert mismatches(key, w8) == ["quantization (built for None, this worker 'fp8')"]
    with pytest.raises(ValueError, match="missing gpu_arch"):
        artifact_key("abc", LIMITS, {"gpu_memory_gib": 80}, STACK)


def test_a_worker_quantizing_its_weights_asks_for_an_fp8_engine(tmp_path):
    """The key a worker (or a GPU-less build) computes from its EngineArgs names the scheme its
    weights run: QUANTIZATION=fp8 on a bf16 checkpoint, and none (the field left out) without."""
    from engine import EngineArgs
    from tiny_models import make_tiny_model

    make_tiny_model("llama", str(tmp_path))
    plain = gpuless_key(EngineArgs(model=str(tmp_path)), "sm_90")
    fp8 = gpuless_key(EngineArgs(model=str(tmp_path), quantization="fp8"), "sm_90")
    assert "quantization" not in plain and fp8["quantization"] == "fp8"
    assert mismatches(plain, fp8) == ["quantization (built for None, this worker 'fp8')"]


def test_the_kernel_code_digest_follows_the_engine_sources(tmp_path):
    """Another engine source (a kernel, or the host code choosing its variants) or another kernel
    set gives another digest, so an artifact built by other code is not taken for this one."""
    repo = Path(__file__).resolve().parent.parent
    shutil.copytree(repo / "engine", tmp_path / "engine", ignore=shutil.ignore_patterns("*.pyc"))
    (tmp_path / "warmup").mkdir()
    shutil.copy(repo / "warmup" / "kernel_set.py", tmp_path / "warmup")
    assert kernel_code_digest(tmp_path) == kernel_code_digest()
    for edited in ("engine/attention/triton_attn.py", "warmup/kernel_set.py"):
        path = tmp_path / edited
        before = path.read_text()
        path.write_text(before + "\n# another build\n")
        assert kernel_code_digest(tmp_path) != kernel_code_digest(), edited
        path.write_text(before)
    assert kernel_code_digest(tmp_path) == kernel_code_digest()
    built, here = _key(kernel_code="0000aaaa"), _key()
    assert mismatches(built, here) == ["kernel_code (built for '0000aaaa', this worker '0123abcd')"]


def test_an_artifact_for_another_arch_and_torch_is_refused_with_the_exact_fields(tmp_path):
    built = _key(gpu_arch="sm_80", torch="2.10.0+cu128")
    path = _write_artifact(tmp_path, built)
    with pytest.raises(ArtifactError) as err:
        select("compiled", [str(tmp_path)], _key())
    assert str(err.value) == (
        "ENGINE_MODE=compiled: no compiled engine matches this worker: "
        f"the closest, {path}, differs in gpu_arch (built for 'sm_80', this worker 'sm_90'); "
        "torch (built for '2.10.0+cu128', this worker '2.11.0+cu130')"
    )
    assert "\n" not in str(err.value)
    sel = select("auto", [str(tmp_path)], _key())  # auto: jit, saying why
    assert (sel.mode, sel.artifact) == ("jit", None)
    assert sel.reason == "ENGINE_MODE=auto: jit, " + str(err.value).removeprefix(
        "ENGINE_MODE=compiled: "
    )


def test_the_closest_artifact_is_named_and_a_matching_one_is_chosen(tmp_path):
    far = _key(gpu_arch="sm_80", torch="2.10.0", triton="3.5.0")
    near = _key(max_model_len=8192)
    _write_artifact(tmp_path, far)
    near_dir = _write_artifact(tmp_path, near)
    with pytest.raises(
        ArtifactError,
        match=rf"the closest, {near_dir}, differs in max_model_len \(built for 8192, "
        r"this worker 4096\)$",
    ):
        select("compiled", [str(tmp_path / "missing"), str(tmp_path)], _key())
    exact = _write_artifact(tmp_path, _key())
    for mode in ("compiled", "auto"):
        sel = select(mode, [str(tmp_path)], _key())
        assert (sel.mode, sel.artifact) == ("compiled", str(exact))
    assert select("jit", [str(tmp_path)], _key()).mode == "jit"


def test_no_artifact_at_all_names_where_it_looked(tmp_path):
    roots = artifact_roots(str(tmp_path / "model"), str(tmp_path / "cache"))
    with pytest.raises(ArtifactError, match="none was found in .*model/engines, .*cache/engines$"):
        select("compiled", roots, _key())
    assert select("auto", roots, _key()).mode == "jit"
    with pytest.raises(
        ValueError, match="ENGINE_MODE: must be one of auto, jit, compiled, got 'fast'"
    ):
        select("fast", roots, _key())
    assert mismatches(_key(), _key()) == []


def test_install_adds_the_kernels_keeps_what_is_there_and_returns_the_record(tmp_path):
    # where the build's Triton wrote the group's files
    built_at = "/tmp/.build-gone/triton-cache/k2"
    group = {
        "child_paths": {
            "kernel.cubin": f"{built_at}/kernel.cubin",
            "kernel.json": f"{built_at}/kernel.json",
        }
    }
    art = _write_artifact(
        tmp_path / "engines",
        _key(),
        {
            "k1/kernel.cubin": b"new",
            "k2/kernel.json": b"{}",
            "k2/kernel.cubin": b"bin",
            "k2/__grp__kernel.json": json.dumps(group).encode(),
        },
    )
    cache = tmp_path / "triton"
    (cache / "k1").mkdir(parents=True)
    (cache / "k1" / "kernel.cubin").write_bytes(b"mine")
    overrides = install(str(art), str(cache))
    assert overrides == {"kv_step_bytes": 123456789, "cuda_graph_sizes": [1, 2, 4, 8]}
    assert (cache / "k1" / "kernel.cubin").read_bytes() == b"mine"
    assert (cache / "k2" / "kernel.json").read_bytes() == b"{}"
    # the group now names the installed files, which Triton checks exist before it skips a compile
    moved = json.loads((cache / "k2" / "__grp__kernel.json").read_text())["child_paths"]
    assert moved == {
        "kernel.cubin": str(cache / "k2" / "kernel.cubin"),
        "kernel.json": str(cache / "k2" / "kernel.json"),
    }
    assert all(os.path.exists(p) for p in moved.values())


def test_a_second_install_of_the_same_artifact_walks_nothing(tmp_path, monkeypatch):
    art = _write_artifact(tmp_path / "engines", _key(), {"k1/kernel.cubin": b"bin"})
    cache = tmp_path / "triton"
    install(str(art), str(cache))
    (cache / "k1" / "kernel.cubin").unlink()  # the walk would copy it back
    walked = []
    monkeypatch.setattr(os, "listdir", lambda *a: walked.append(a) or [])
    monkeypatch.setattr(os, "scandir", lambda *a: walked.append(a) or iter(()))
    assert install(str(art), str(cache))["kv_step_bytes"] == 123456789
    assert walked == [] and not (cache / "k1" / "kernel.cubin").exists()
    monkeypatch.undo()
    # another artifact (here: the same key rebuilt with another record) is walked and copied
    other = json.loads((art / ARTIFACT_FILE).read_text())
    other["record"]["graph_sizes"] = [1]
    (art / ARTIFACT_FILE).write_text(json.dumps(other))
    assert install(str(art), str(cache))["cuda_graph_sizes"] == [1]
    assert (cache / "k1" / "kernel.cubin").read_bytes() == b"bin"


def test_an_installed_artifact_is_a_hit_for_tritons_own_cache_manager(tmp_path, monkeypatch):
    triton_cache = pytest.importorskip("triton.runtime.cache")
    built = tmp_path / "build" / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(built))
    # the build's Triton writes a kernel and its group
    writer = triton_cache.FileCacheManager("abc")
    paths = {
        "k.cubin": writer.put(b"\x7fELF", "k.cubin"),
        "k.json": writer.put("{}", "k.json", binary=False),
    }
    writer.put_group("k.json", paths)
    art = tmp_path / "engines" / "a1"
    # the artifact is published elsewhere, the build dir removed
    shutil.copytree(built, art / TRITON_DIR)
    (art / ARTIFACT_FILE).write_text(
        json.dumps({"key": _key(), "record": {"kv_step_bytes": 1, "graph_sizes": [1]}})
    )
    shutil.rmtree(tmp_path / "build")
    fresh = tmp_path / "worker-triton"
    install(str(art), str(fresh))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    group = triton_cache.FileCacheManager("abc").get_group("k.json")
    assert group is not None and set(group) == {"k.cubin", "k.json"}


def test_on_cpu_compiled_is_refused_and_auto_runs_jit(tmp_path):
    from engine import EngineArgs

    args = EngineArgs(model=str(tmp_path), device="cpu")
    with pytest.raises(
        ArtifactError,
        match="^ENGINE_MODE=compiled: compiled engines are for CUDA devices; this "
        "engine runs on cpu$",
    ):
        prepare("compiled", args)
    for mode in ("auto", "jit"):
        same, sel = prepare(mode, args)
        assert same is args and sel.mode == "jit"


def test_a_worker_with_engine_mode_compiled_and_no_gpu_fails_its_start_in_one_line(
    smollm2_dir, tmp_path
):
    from handler.config import load_settings
    from handler.engine_boot import EngineBoot

    boot = EngineBoot(
        load_settings(
            {
                "MODEL_NAME": smollm2_dir,
                "DEVICE": "cpu",
                "ENGINE_MODE": "compiled",
                "CACHE_DIR": str(tmp_path),
            }
        )
    )
    with pytest.raises(
        ArtifactError, match="^ENGINE_MODE=compiled: compiled engines are for CUDA devices"
    ):
        asyncio.run(boot.ready())


# ---- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_built_engine_gives_the_same_greedy_tokens_as_jit(tmp_path):
    from engine import LLM, EngineArgs, SamplingParams
    from tests.tiny_models import make_tiny_model
    from warmup.build import smoke_prompt

    model_dir = str(tmp_path / "model")
    make_tiny_model("llama", model_dir)
    limits = [
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "16",
        "--gpu-memory-utilization",
        "0.3",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "warmup", "build", "--model", model_dir, *limits],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    path = out.stdout.splitlines()[0]
    data = json.loads((Path(path) / ARTIFACT_FILE).read_text())
    assert any((Path(path) / TRITON_DIR).rglob("*.cubin"))  # the kernels it compiled
    assert "build time" in out.stdout
    args = EngineArgs(
        model=model_dir,
        dtype="bfloat16",
        device="cuda",
        max_model_len=128,
        max_num_seqs=16,
        gpu_memory_utilization=0.3,
    )
    compiled_args, sel = prepare("compiled", args)
    assert sel.mode == "compiled" and sel.artifact == path
    assert compiled_args.kv_step_bytes == data["record"]["kv_step_bytes"]
    prompts = [smoke_prompt(256)] + [[5, 9, 17, 33, 2 + i] * (1 + i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for name, a in (("jit", args), ("compiled", compiled_args)):
        llm = LLM(**vars(a))
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        free_gpu_memory()
    assert tokens["compiled"] == tokens["jit"]
    assert tokens["jit"][0] == data["record"]["smoke_tokens"]
    with pytest.raises(ArtifactError, match="max_model_len \\(built for 128, this worker 512\\)"):
        prepare("compiled", EngineArgs(**{**vars(args), "max_model_len": 512}))


def test_an_artifact_pushed_to_the_fleet_cache_is_pulled_by_key_and_chosen(tmp_path):
    from cache import remote
    from cache_servers import S3Server
    from warmup.artifacts import pull_matching

    key = _key()
    art = _write_artifact(tmp_path / "built", key, {"k1/kernel.cubin": b"\x7fELF"})
    cache_dir = str(tmp_path / "worker-cache")
    with S3Server() as s3:
        opts = s3.options()
        # nothing pushed yet
        assert pull_matching(key, "s3://fleet/prefix", cache_dir, opts) is None
        # as --push does
        remote.push_dir(art, f"s3://fleet/prefix/engines/{key_id(key)}", opts, progress=False)
        # another key
        assert pull_matching(_key(gpu_arch="sm_80"), "s3://fleet/prefix", cache_dir, opts) is None
        path = pull_matching(key, "s3://fleet/prefix", cache_dir, opts)
    assert path == os.path.join(cache_dir, "engines", key_id(key))
    # no staging left behind
    assert sorted(os.listdir(os.path.join(cache_dir, "engines"))) == [key_id(key)]
    sel = select("compiled", artifact_roots(str(tmp_path / "model"), cache_dir), key)
    assert (sel.mode, sel.artifact) == ("compiled", path)
    assert (Path(path) / TRITON_DIR / "k1" / "kernel.cubin").read_bytes() == b"\x7fELF"
    # already here: no S3 call at all
    assert pull_matching(key, "s3://fleet/prefix", cache_dir, None) == path
