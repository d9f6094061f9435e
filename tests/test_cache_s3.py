"""S3 through moto's real server on loopback (boto3 with endpoint_url): s3:// sources, push and pull
of any directory, the fleet cache between hub and workers, an S3 store that is down or silent, and
no credential in any log line.

`make test` also runs this file with the oldest boto3 we admit first on PYTHONPATH
(COLDBREW_BOTO3_VERSION names the version that must be the one imported, here and in the CLI's
processes).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cache import remote, resolve
from cache.remote import RemoteError
from cache.snapshot import MANIFEST, check_snapshot, read_manifest
from cache_servers import FakeHub, FakeRepo, S3Server, tiny_model_files, upload_tree
from child_process import repo_pythonpath

REPO = Path(__file__).resolve().parent.parent
HF_TOKEN = "hf_AnotherSecretHubToken123"


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    return tiny_model_files(tmp_path_factory.mktemp("models"), seed=3)


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


@pytest.fixture
def hub(model_files):
    with FakeHub(token=HF_TOKEN) as server:
        repo = FakeRepo()
        server.commit = repo.add_commit(model_files)
        server.repos["org/tiny"] = repo
        yield server


def _engine_files(files):
    return {k: v for k, v in files.items() if k.endswith((".json", ".safetensors"))}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_client_under_test_is_the_version_asked_for():
    """boto3 and botocore, here and in a child started as the CLI tests start theirs: the version
    COLDBREW_BOTO3_VERSION names (make test-clients-oldest, which names pyproject's floor:
    tests/test_packaging.py), else the lock's."""
    import boto3
    import botocore

    script = "import boto3, botocore; print(boto3.__version__, botocore.__version__)"
    child = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": repo_pythonpath()},
        capture_output=True,
        text=True,
    )
    assert child.stdout.split() == [boto3.__version__, botocore.__version__], child.stderr
    wanted = os.environ.get("COLDBREW_BOTO3_VERSION")
    if wanted:  # make installs the botocore of boto3's own number, as the lock pairs them
        assert (boto3.__version__, botocore.__version__) == (wanted, wanted)


def test_an_s3_source_gives_a_snapshot_of_the_engine_files(s3, model_files, tmp_path, caplog):
    # the test's own client: not under test
    upload_tree(s3.client(), s3.bucket, "models/tiny", model_files)
    caplog.set_level(logging.DEBUG)
    path = resolve(
        "s3://fleet/models/tiny",
        cache_dir=tmp_path / "c",
        base_path=None,
        s3_options=s3.options(),
        progress=False,
    )
    wanted = _engine_files(model_files)
    assert {p.name for p in path.iterdir()} == set(wanted) | {MANIFEST}
    assert all((path / n).read_bytes() == d for n, d in wanted.items())
    assert (
        read_manifest(path)["source"] == "s3://fleet/models/tiny"
        and check_snapshot(path, "full") is None
    )
    assert s3.SECRET not in caplog.text and s3.KEY_ID not in caplog.text
    # botocore logged its requests
    assert any("Sending http request" in r.getMessage() for r in caplog.records)


def test_push_and_pull_round_trip_any_directory_and_the_manifest_marks_completion(s3, tmp_path):
    src = tmp_path / "artifact"
    (src / "packs").mkdir(parents=True)
    (src / "packs" / "weights.pack").write_bytes(os.urandom(300_000))
    (src / "index.json").write_text('{"a": 1}')
    opts = s3.options()
    manifest = remote.push_dir(src, "s3://fleet/artifacts/a1", opts, progress=False)
    assert set(manifest["files"]) == {"packs/weights.pack", "index.json"}
    dest = tmp_path / "pulled"
    dest.mkdir()
    assert (
        remote.pull_dir("s3://fleet/artifacts/a1", dest, opts, verify="full", progress=False)
        == manifest
    )
    assert (dest / "packs" / "weights.pack").read_bytes() == (
        src / "packs" / "weights.pack"
    ).read_bytes()
    assert check_snapshot(dest, "full") is None
    # Files without their manifest (a push that died half-way) are not a complete copy.
    s3.client().put_object(Bucket="fleet", Key="artifacts/half/index.json", Body=b"{}")
    assert (
        remote.pull_dir("s3://fleet/artifacts/half", tmp_path / "x", opts, progress=False) is None
    )


def test_the_fleet_cache_serves_workers_without_the_hub(s3, hub, model_files, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    fleet = "s3://fleet/cache-1"
    first = resolve(
        "org/tiny",
        cache_dir=tmp_path / "w1",
        base_path=None,
        endpoint=hub.url,
        token=HF_TOKEN,
        remote=fleet,
        push=True,
        s3_endpoint_url=s3.url,
        aws_access_key_id=s3.KEY_ID,
        aws_secret_access_key=s3.SECRET,
        aws_region="us-east-1",
        progress=False,
    )
    keys = {
        o["Key"] for o in s3.client().list_objects_v2(Bucket="fleet", Prefix="cache-1/")["Contents"]
    }
    assert "cache-1/refs/hf--org--tiny/main" in keys
    assert f"cache-1/snapshots/hf--org--tiny/{hub.commit}/{MANIFEST}" in keys
    # A second worker: the hub is gone (dead endpoint), the branch name still resolves through the
    # fleet cache.
    hub_requests = len(hub.log)
    dead_hub = f"http://127.0.0.1:{_closed_port()}"
    second = resolve(
        "org/tiny",
        cache_dir=tmp_path / "w2",
        base_path=None,
        endpoint=dead_hub,
        remote=fleet,
        s3_options=s3.options(),
        progress=False,
    )
    assert len(hub.log) == hub_requests
    assert second != first and second.name == hub.commit
    assert read_manifest(second) == read_manifest(first)
    assert all((second / n).read_bytes() == d for n, d in _engine_files(model_files).items())
    assert "remote cache" in caplog.text
    for secret in (s3.SECRET, s3.KEY_ID, HF_TOKEN):
        assert secret not in caplog.text


def test_cli_push_pull_ls_fetch(s3, hub, model_files, tmp_path):
    env = {
        **os.environ,
        **s3.env(),
        "PYTHONPATH": repo_pythonpath(),
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": HF_TOKEN,
    }

    def cli(*args):
        out = subprocess.run(
            [sys.executable, "-m", "cache", *args, "--quiet"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for secret in (s3.SECRET, s3.KEY_ID, HF_TOKEN):
            assert secret not in out.stdout + out.stderr
        return out

    fetched = cli("fetch", "org/tiny", "--cache-dir", str(tmp_path / "a"), "-v")
    assert fetched.returncode == 0, fetched.stderr
    snap = Path(fetched.stdout.strip().splitlines()[-1])
    assert snap.name == hub.commit and check_snapshot(snap, "full") is None
    pushed = cli("push", str(snap), "s3://fleet/cli", "--s3-endpoint-url", s3.url, "-v")
    assert pushed.returncode == 0, pushed.stderr
    uri = pushed.stdout.strip().splitlines()[-1]
    assert uri == f"s3://fleet/cli/snapshots/hf--org--tiny/{hub.commit}"
    pulled = cli(
        "pull",
        uri,
        "--cache-dir",
        str(tmp_path / "b"),
        "--s3-endpoint-url",
        s3.url,
        "--verify",
        "full",
    )
    assert pulled.returncode == 0, pulled.stderr
    copy = Path(pulled.stdout.strip().splitlines()[-1])
    assert copy == tmp_path / "b" / "snapshots" / "hf--org--tiny" / hub.commit
    assert all(
        (copy / n).read_bytes() == (snap / n).read_bytes() for n in read_manifest(snap)["files"]
    )
    listed = cli("ls", "--cache-dir", str(tmp_path / "b"))
    assert listed.returncode == 0
    # a tiny model: hundreds of KB
    size_kb = sum(len(d) for d in _engine_files(model_files).values()) / 1e3
    line = next(ln for ln in listed.stdout.splitlines() if "hf://org/tiny" in ln)
    assert hub.commit in line and f"{size_kb:.1f} KB" in line and " ok " in line
    # fetch from the fleet cache through the CLI, hub unreachable
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    fetched = cli(
        "fetch",
        "org/tiny",
        "--cache-dir",
        str(tmp_path / "c"),
        "--remote",
        "s3://fleet/cli",
        "--s3-endpoint-url",
        s3.url,
    )
    assert fetched.returncode == 0, fetched.stderr
    assert Path(fetched.stdout.strip().splitlines()[-1]).name == hub.commit
    missing = cli(
        "pull",
        "s3://fleet/nothing-here",
        "--cache-dir",
        str(tmp_path / "d"),
        "--s3-endpoint-url",
        s3.url,
    )
    assert missing.returncode != 0 and "coldbrew-manifest.json not found" in missing.stderr


def test_an_unreachable_store_is_a_clear_error_or_falls_back_to_the_source(
    s3, hub, model_files, tmp_path, caplog
):
    caplog.set_level(logging.DEBUG)
    dead = s3.options(
        endpoint_url=f"http://127.0.0.1:{_closed_port()}", connect_timeout=1, max_attempts=2
    )
    with pytest.raises(RemoteError) as err:
        resolve(
            "org/tiny",
            cache_dir=tmp_path / "a",
            base_path=None,
            endpoint=hub.url,
            token=HF_TOKEN,
            remote="s3://fleet/cache-x",
            remote_fallback=False,
            s3_options=dead,
            progress=False,
        )
    assert dead.endpoint_url in str(err.value) and "s3://fleet/cache-x" in str(err.value)
    assert hub.file_gets() == 0
    path = resolve(
        "org/tiny",
        cache_dir=tmp_path / "a",
        base_path=None,
        endpoint=hub.url,
        token=HF_TOKEN,
        remote="s3://fleet/cache-x",
        s3_options=dead,
        progress=False,
    )
    assert check_snapshot(path) is None and hub.file_gets() == len(_engine_files(model_files))
    warnings = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "remote cache unusable" in r.getMessage()
    ]
    assert len(warnings) == 1
    for secret in (s3.SECRET, s3.KEY_ID, HF_TOKEN):
        assert secret not in caplog.text and secret not in str(err.value)


def test_a_silent_store_times_out_instead_of_hanging(s3, tmp_path):
    with socket.socket() as black_hole:  # accepts connections (backlog) and never answers
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(16)
        url = f"http://127.0.0.1:{black_hole.getsockname()[1]}"
        env = {**os.environ, **s3.env(), "PYTHONPATH": repo_pythonpath()}
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "cache",
                "fetch",
                "s3://fleet/models/tiny",
                "--cache-dir",
                str(tmp_path / "c"),
                "--s3-endpoint-url",
                url,
                "--s3-timeout",
                "1",
                "--s3-read-timeout",
                "1",
                "--s3-attempts",
                "1",
                "--quiet",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert out.returncode == 1
    assert (
        "ReadTimeoutError" in out.stderr
        and url in out.stderr
        and "s3://fleet/models/tiny" in out.stderr
    )
    assert s3.SECRET not in out.stderr
