"""The hub source through the real huggingface_hub client against a loopback fake hub: revisions, the manifest,
token, file selection, corruption and quarantine, a fetch SIGKILLed mid-download, four processes fetching at once.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cache import resolve
from cache.snapshot import MANIFEST, check_snapshot, read_manifest
from cache.sources import SourceError
from cache_servers import FakeHub, FakeRepo, tiny_model_files

REPO = Path(__file__).resolve().parent.parent
TOKEN = "hf_TestTokenThatMustNeverBeLogged42"
WEIGHTS = "model-00002-of-00005.safetensors"


@pytest.fixture(scope="module")
def revisions(tmp_path_factory):
    """Two commits of one repo with different weights: v1 on tag 'v1', v2 on main."""
    tmp = tmp_path_factory.mktemp("models")
    return tiny_model_files(tmp, seed=1), tiny_model_files(tmp, seed=2)


@pytest.fixture
def hub(revisions):
    with FakeHub(token=TOKEN) as server:
        repo = FakeRepo()
        c1 = repo.add_commit(revisions[0], branch="v1")
        c2 = repo.add_commit(revisions[1], branch="main")
        server.repos["Org/Tiny-LM"] = repo
        server.commits = (c1, c2)
        yield server


def _engine_files(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k.endswith((".json", ".safetensors"))}


def _fetch(hub, tmp_path, **kw):
    kw.setdefault("cache_dir", tmp_path / "cache")
    return resolve("org/tiny-lm", endpoint=hub.url, token=TOKEN, base_path=None, progress=False, **kw)


def _cli(args, env_extra, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_extra}
    return subprocess.Popen([sys.executable, "-m", "cache", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_revisions_fetch_their_own_content_and_the_manifest_records_the_commit(hub, revisions, tmp_path):
    c1, c2 = hub.commits
    main = _fetch(hub, tmp_path)
    tagged = _fetch(hub, tmp_path, revision="v1")
    by_commit = _fetch(hub, tmp_path, revision=c1)
    assert tagged == by_commit != main
    for path, files, commit, requested in ((main, revisions[1], c2, "main"), (tagged, revisions[0], c1, "v1")):
        wanted = _engine_files(files)
        on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
        assert on_disk == set(wanted) | {MANIFEST}  # no README, no .bin, no .pth
        assert all((path / name).read_bytes() == data for name, data in wanted.items())
        manifest = read_manifest(path)
        assert manifest["revision"] == commit and manifest["requested_revision"] == requested
        assert manifest["source"] == "hf://org/tiny-lm" and manifest["coldbrew_version"]
        assert {n: e["size"] for n, e in manifest["files"].items()} == {n: len(d) for n, d in wanted.items()}
        assert check_snapshot(path, "full") is None
    assert revisions[0][WEIGHTS] != revisions[1][WEIGHTS]
    # The engine loads the snapshot as a model directory.
    from engine import LLM, SamplingParams

    out = LLM(model=str(main), device="cpu", max_model_len=64).generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_fetched_branch_is_served_from_the_cache_without_the_hub(hub, tmp_path):
    first = _fetch(hub, tmp_path)
    before = len(hub.log)
    again = resolve("Org/Tiny-LM", cache_dir=tmp_path / "cache", endpoint="http://127.0.0.1:9", base_path=None)
    assert again == first and len(hub.log) == before


def test_the_token_is_sent_and_a_wrong_one_is_refused_without_echoing_it(hub, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "hf_WrongTokenAlsoSecret77"
    with pytest.raises(SourceError) as err:
        resolve("org/tiny-lm", cache_dir=tmp_path / "c", endpoint=hub.url, token=wrong, base_path=None)
    assert "org/tiny-lm" in str(err.value) and "401" in str(err.value)
    assert wrong not in str(err.value)
    path = _fetch(hub, tmp_path)
    assert check_snapshot(path) is None
    for record in caplog.records:
        assert TOKEN not in record.getMessage() and wrong not in record.getMessage()
    assert TOKEN not in caplog.text and wrong not in caplog.text


def test_a_truncated_weight_file_is_quarantined_and_rebuilt_with_one_log_line(hub, revisions, tmp_path, caplog):
    path = _fetch(hub, tmp_path)
    weights = path / WEIGHTS
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    gets = hub.file_gets(WEIGHTS)
    caplog.set_level(logging.INFO, logger="cache")
    again = _fetch(hub, tmp_path)
    assert again == path and weights.read_bytes() == revisions[1][WEIGHTS]
    assert hub.file_gets(WEIGHTS) == gets + 1
    lines = [r for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and WEIGHTS in lines[0].getMessage()
    quarantined = list((tmp_path / "cache" / ".quarantine").iterdir())
    assert len(quarantined) == 1 and (quarantined[0] / WEIGHTS).stat().st_size < len(revisions[1][WEIGHTS])


def test_a_flipped_byte_is_caught_only_by_full_verification(hub, revisions, tmp_path):
    path = _fetch(hub, tmp_path)
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (path / WEIGHTS).write_bytes(bytes(data))
    assert _fetch(hub, tmp_path) == path and check_snapshot(path) is None  # sizes agree
    assert "sha256" in check_snapshot(path, "full")
    assert _fetch(hub, tmp_path, verify="full") == path
    assert (path / WEIGHTS).read_bytes() == revisions[1][WEIGHTS]


def test_bytes_that_differ_from_the_hubs_own_hashes_are_refused_and_nothing_is_published(hub, revisions, tmp_path):
    hub.corrupt_file = WEIGHTS
    with pytest.raises(SourceError, match=f"{WEIGHTS} arrived with hash"):
        _fetch(hub, tmp_path)
    assert not list((tmp_path / "cache" / "snapshots").glob("*/*"))
    hub.corrupt_file = None
    path = _fetch(hub, tmp_path)
    assert (path / WEIGHTS).read_bytes() == revisions[1][WEIGHTS]


def test_a_fetch_killed_mid_download_leaves_nothing_valid_and_the_next_start_completes(hub, revisions, tmp_path):
    cache_dir = tmp_path / "cache"
    hub.stall_file = WEIGHTS
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    proc = _cli(["fetch", "org/tiny-lm", "--cache-dir", str(cache_dir), "--quiet"], env)
    try:
        assert hub.stalled.wait(90), "the fetch never reached the stalled file"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not list((cache_dir / "snapshots").glob("*/*")), "a killed fetch published something"
    assert list((cache_dir / ".staging").iterdir()), "the fetch was not mid-download"
    hub.stall_file = None
    hub.release.set()
    proc = _cli(["fetch", "org/tiny-lm", "--cache-dir", str(cache_dir), "--quiet"], env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    path = Path(out.strip().splitlines()[-1])
    assert check_snapshot(path, "full") is None
    assert (path / WEIGHTS).read_bytes() == revisions[1][WEIGHTS]
    assert not (path / ".cache").exists()


def test_four_processes_fetching_at_once_download_once_and_agree(hub, revisions, tmp_path):
    hub.gate_after_infos = 4  # weights are held back until all four have asked for the revision
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    procs = [_cli(["fetch", "org/tiny-lm", "--cache-dir", str(tmp_path / "cache"), "--quiet"], env)
             for _ in range(4)]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [r[1][-2000:] for r in results]
    paths = {r[0].strip().splitlines()[-1] for r in results}
    assert len(paths) == 1
    assert hub.gate.is_set()
    names = _engine_files(revisions[1])
    for name in names:
        assert hub.file_gets(name) == 1, name
    assert hub.file_gets() == len(names)
    path = Path(paths.pop())
    assert check_snapshot(path, "full") is None
    assert json.loads((path / MANIFEST).read_text())["revision"] == hub.commits[1]
