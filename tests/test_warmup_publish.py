"""Publishing a compiled engine for the fleet: two worker processes racing on one volume directory,
and on S3 (moto's server), publish one artifact, which a later worker finds, pulls and installs as
Triton cache hits.

The racers are real processes running warmup.publish as a worker's share does: stage the kernels
from their own Triton cache, then publish, released together by a file barrier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from child_process import repo_pythonpath
from warmup.artifacts import (
    ARTIFACT_FILE,
    ENGINES_DIR,
    TRITON_DIR,
    any_memory,
    artifact_key,
    artifact_roots,
    install,
    key_id,
    select,
)

REPO = Path(__file__).resolve().parent.parent
LIMITS = {
    "dtype": "bfloat16",
    "max_model_len": 4096,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "block_size": 16,
    "gpu_memory_utilization": 0.95,
}
STACK = {"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "kernel_code": "0123abcd"}

RACER = r"""
import json, os, sys, time
from warmup.publish import publish_local, publish_remote, stage_from_cache
cache, root, key, barrier, me, remote = sys.argv[1:7]
key = json.loads(key)
staging = stage_from_cache(cache, sorted(os.listdir(cache)), key, {"graph_sizes": [1, 2], "by": me},
root)
open(os.path.join(barrier, me), "w").close()
while len(os.listdir(barrier)) < 2:
    time.sleep(0.001)
final, local = publish_local(staging, root, key, replace=False)
opts = None
if remote != "-":
    from cache.remote import S3Options
    opts = S3Options(endpoint_url=os.environ["S3_ENDPOINT"], region="us-east-1")
pushed = publish_remote(final, remote, key, opts) if remote != "-" else None
print(json.dumps({"final": final, "local": local, "remote": pushed}))
"""


def worker_key(**changes) -> dict:
    device = {"gpu_arch": "sm_90", "gpu_memory_gib": 80, **changes}
    return artifact_key("abc123", LIMITS, device, STACK)


def fake_triton_cache(path: Path, build_dir: str) -> Path:
    """Two entries as Triton's FileCacheManager leaves them: files and a group naming them by
    absolute path."""
    for entry, name in (("AAAA", "_rms_norm_kernel"), ("BBBB", "paged_attention_kernel")):
        d = path / entry
        d.mkdir(parents=True)
        files = {
            f"{name}.cubin": b"\x7fELF" + entry.encode(),
            f"{name}.json": b'{"name": "%s"}' % name.encode(),
        }
        for fname, data in files.items():
            (d / fname).write_bytes(data)
        group = {"child_paths": {f: f"{build_dir}/{entry}/{f}" for f in files}}
        (d / f"__grp__{name}.json").write_text(json.dumps(group))
    (path / "CCCC").mkdir()  # an entry still being compiled (no group file yet): left out
    (path / "CCCC" / "x.ttir").write_text("partial")
    return path


def race(tmp_path: Path, root: Path, remote: str = "-", env: dict | None = None) -> list[dict]:
    key = any_memory(worker_key())
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = []
    for me in ("w1", "w2"):
        cache = fake_triton_cache(tmp_path / f"triton-{me}", f"/home/{me}/.triton/cache")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    RACER,
                    str(cache),
                    str(root),
                    json.dumps(key),
                    str(barrier),
                    me,
                    remote,
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": repo_pythonpath(), **(env or {})},
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_two_workers_publishing_on_one_volume_publish_one_artifact(tmp_path):
    root = tmp_path / "volume" / "model" / ENGINES_DIR
    results = race(tmp_path, root)
    # one rename; the other found it published
    assert sorted(r["local"] for r in results) == [False, True]
    final = Path(results[0]["final"])
    assert final == root / key_id(any_memory(worker_key())) and results[1]["final"] == str(final)
    assert sorted(os.listdir(root)) == [".locks", final.name]  # no staging directory left behind
    data = json.loads((final / ARTIFACT_FILE).read_text())
    assert data["record"]["kernels"] == {
        "AAAA": "_rms_norm_kernel",
        "BBBB": "paged_attention_kernel",
    }
    assert sorted(os.listdir(final / TRITON_DIR)) == ["AAAA", "BBBB"]
    group = json.loads((final / TRITON_DIR / "AAAA" / "__grp___rms_norm_kernel.json").read_text())
    assert set(group["child_paths"].values()) == {"_rms_norm_kernel.cubin", "_rms_norm_kernel.json"}
    # the next worker on that volume (an H100 of 80 GiB at 0.95): the artifact matches and installs
    # as cache hits
    sel = select("auto", artifact_roots(str(root.parent), None), worker_key())
    assert (sel.mode, sel.artifact) == ("compiled", str(final))
    worker_cache = tmp_path / "next-worker-triton"
    assert install(sel.artifact, str(worker_cache)) == {"cuda_graph_sizes": [1, 2]}
    moved = json.loads((worker_cache / "AAAA" / "__grp___rms_norm_kernel.json").read_text())[
        "child_paths"
    ]
    assert all(os.path.exists(p) and p.startswith(str(worker_cache)) for p in moved.values())


def test_two_workers_publishing_to_s3_at_once_publish_one_artifact_that_the_next_worker_pulls(
    tmp_path,
):
    from cache import remote as s3
    from cache_servers import S3Server
    from warmup.artifacts import pull_matching
    from warmup.publish import publish_remote

    with S3Server() as server:
        env = {**server.env(), "S3_ENDPOINT": server.url}
        # each worker publishes to its own volume (no shared disk), both to the one bucket
        results = []
        for i, me in enumerate(("a", "b")):
            sub = tmp_path / me
            sub.mkdir()
            results.append(race(sub, sub / "volume" / ENGINES_DIR, "s3://fleet/race", env))
        flat = [r for pair in results for r in pair]
        # one manifest landed; the other three found it
        assert sum(bool(r["remote"]) for r in flat) == 1
        key = any_memory(worker_key())
        uri = f"s3://fleet/race/{ENGINES_DIR}/{key_id(key)}"
        manifest = s3.read_manifest_at(uri, server.options())
        assert sorted(manifest["files"]) == [ARTIFACT_FILE] + [
            f"{TRITON_DIR}/{e}/{f}"
            for e, n in (("AAAA", "_rms_norm_kernel"), ("BBBB", "paged_attention_kernel"))
            for f in sorted([f"__grp__{n}.json", f"{n}.cubin", f"{n}.json"])
        ]
        assert publish_remote(flat[0]["final"], "s3://fleet/race", key, server.options()) is False
        # a worker with an empty volume and the same key but its own memory size pulls it
        cache_dir = tmp_path / "worker-cache"
        path = pull_matching(worker_key(), "s3://fleet/race", str(cache_dir), server.options())
    assert path == str(cache_dir / ENGINES_DIR / key_id(key))
    sel = select("compiled", [str(cache_dir / ENGINES_DIR)], worker_key())
    assert sel.artifact == path
    assert (
        Path(path) / TRITON_DIR / "BBBB" / "paged_attention_kernel.cubin"
    ).read_bytes() == b"\x7fELFBBBB"


@pytest.mark.parametrize("fields", [{"gpu_memory_gib": 40}, {"gpu_memory_gib": 141}])
def test_an_artifact_without_a_memory_record_matches_any_memory_and_an_exact_one_comes_first(
    tmp_path, fields
):
    from warmup.publish import publish_local, staging_dir, write_artifact_file

    root = tmp_path / ENGINES_DIR
    wanted = worker_key(**fields)
    for key, record in (
        (any_memory(worker_key()), {"graph_sizes": [1], "kv_step_bytes": None}),
        (wanted, {"graph_sizes": [1, 2], "kv_step_bytes": 1234}),
    ):
        staging = staging_dir(str(root), "build")
        os.makedirs(os.path.join(staging, TRITON_DIR))
        write_artifact_file(staging, key, record)
        publish_local(staging, str(root), key, replace=True)
        sel = select("compiled", [str(root)], wanted)
        assert sel.artifact == str(root / key_id(key))  # the exact (measured) one once it is there
    assert install(sel.artifact, str(tmp_path / "t")) == {
        "cuda_graph_sizes": [1, 2],
        "kv_step_bytes": 1234,
    }
    other_arch = select("auto", [str(root)], worker_key(gpu_arch="sm_89"))
    assert (
        other_arch.mode == "jit"
        and "gpu_arch (built for 'sm_90', this worker 'sm_89')" in other_arch.reason
    )


def test_a_published_artifact_carries_tritons_c_modules_and_installs_them(tmp_path):
    from warmup.artifacts import install
    from warmup.publish import stage_from_cache

    cache = fake_triton_cache(tmp_path / "triton", "/home/w1/.triton/cache")
    launcher = cache / "DDDD" / "__triton_launcher.cpython-312-x86_64-linux-gnu.so"
    utils = cache / "EEEE" / "cuda_utils.cpython-312-x86_64-linux-gnu.so"
    for module in (launcher, utils):  # as Triton's build.py puts them: one file, no group
        module.parent.mkdir()
        module.write_bytes(b"\x7fELF " + module.name.encode())
    key = any_memory(worker_key())
    # the entries a worker names are its kernels'; the launchers are found in the cache
    staging = stage_from_cache(
        str(cache), ["AAAA", "BBBB"], key, {"graph_sizes": [1]}, str(tmp_path)
    )
    staged = Path(staging) / "triton-cache"
    assert sorted(os.listdir(staged)) == ["AAAA", "BBBB", "DDDD", "EEEE"]
    assert json.loads((Path(staging) / "artifact.json").read_text())["record"]["kernels"] == {
        "AAAA": "_rms_norm_kernel",
        "BBBB": "paged_attention_kernel",
    }
    fresh = tmp_path / "worker-triton"
    install(staging, str(fresh))
    for module in (launcher, utils):
        assert (fresh / module.parent.name / module.name).read_bytes() == module.read_bytes()
