"""The hub source through the real huggingface_hub client against the stand-in hub of cache_servers
(LFS pointers, the CDN redirect, paginated trees, the hub's error codes): verified shards, refusal
before any weight, gated repos, the index's shards only, hashing once, corruption and quarantine, a
fetch SIGKILLed mid-download, four processes.

`make test` also runs this file with the oldest huggingface_hub we admit first on PYTHONPATH
(COLDBREW_HF_HUB_VERSION names the version that must be the one imported).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import cache.hub
import cache.snapshot
from cache import resolve
from cache.snapshot import MANIFEST, check_snapshot, read_manifest
from cache.sources import SourceError
from cache_servers import FakeHub, FakeRepo, tiny_model_files
from engine.model_support import SUPPORTED_ARCHITECTURES, check_model_config

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
    with FakeHub(token=TOKEN, page_size=3) as server:  # small pages: the listing takes several
        repo = FakeRepo(private=True)
        c1 = repo.add_commit(revisions[0], branch="v1")
        c2 = repo.add_commit(revisions[1], branch="main")
        server.repos["Org/Tiny-LM"] = repo
        server.commits = (c1, c2)
        yield server


def _engine_files(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k.endswith((".json", ".safetensors"))}


def _fetch(hub, tmp_path, repo="org/tiny-lm", **kw):
    kw.setdefault("cache_dir", tmp_path / "cache")
    kw.setdefault("token", TOKEN)
    return resolve(
        repo,
        endpoint=hub.url,
        base_path=None,
        progress=False,
        check_config=check_model_config,
        **kw,
    )


def _env(**extra) -> dict:
    """A child's environment: this checkout first on PYTHONPATH, then the parent's (an older
    client)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _cli(args, env_extra):
    return subprocess.Popen(
        [sys.executable, "-m", "cache", *args],
        cwd=REPO,
        env=_env(**env_extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _one_line_error(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def test_the_client_under_test_is_the_version_asked_for():
    import huggingface_hub

    wanted = os.environ.get("COLDBREW_HF_HUB_VERSION")
    if wanted:  # make's oldest run; that it names pyproject's floor: tests/test_packaging.py
        assert huggingface_hub.__version__ == wanted


def test_lfs_shards_named_by_the_index_download_verified_and_the_engine_loads_them(
    hub, revisions, tmp_path
):
    c1, c2 = hub.commits
    main = _fetch(hub, tmp_path)
    tagged = _fetch(hub, tmp_path, revision="v1")
    by_commit = _fetch(hub, tmp_path, revision=c1)
    assert tagged == by_commit != main
    for path, files, commit, requested in (
        (main, revisions[1], c2, "main"),
        (tagged, revisions[0], c1, "v1"),
    ):
        wanted = _engine_files(files)
        on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
        assert on_disk == set(wanted) | {MANIFEST}  # no README, .gitattributes, .bin, .pth
        assert all((path / name).read_bytes() == data for name, data in wanted.items())
        manifest = read_manifest(path)
        assert manifest["revision"] == commit and manifest["requested_revision"] == requested
        assert manifest["source"] == "hf://org/tiny-lm" and manifest["coldbrew_version"]
        assert manifest["files"] == {
            n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in wanted.items()
        }
        assert check_snapshot(path, "full") is None
    assert revisions[0][WEIGHTS] != revisions[1][WEIGHTS]
    # huggingface_hub's own checker (2.x) agrees: every file we kept matches the hub's listing.
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url, token=TOKEN)
    if hasattr(api, "verify_repo_checksums"):
        checked = api.verify_repo_checksums("org/tiny-lm", revision=c2, local_dir=main)
        assert checked.mismatches == [] and checked.extra_paths == [MANIFEST]
        left_out = set(revisions[1]) - set(_engine_files(revisions[1])) | {".gitattributes"}
        assert set(checked.missing_paths) == left_out
    # The shards came from the CDN without the token; the listing took several pages.
    cdn = [r for r in hub.log if r.server == "cdn"]
    assert cdn and all(r.file.endswith(".safetensors") for r in cdn)
    assert sum(1 for r in hub.log if "/tree/" in r.path) > 1
    from engine import LLM, SamplingParams

    llm = LLM(model=str(main), device="cpu", max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_each_file_is_hashed_once_and_a_second_fetch_makes_no_download_request(
    hub, tmp_path, monkeypatch
):
    reads = Counter()
    real = cache.snapshot.hash_file

    def counted(path, git_blob=False):
        reads[Path(path).name] += 1
        return real(path, git_blob)

    monkeypatch.setattr(cache.hub, "hash_file", counted)
    monkeypatch.setattr(cache.snapshot, "hash_file", counted)
    first = _fetch(hub, tmp_path)
    names = set(read_manifest(first)["files"])
    assert reads == Counter(dict.fromkeys(names, 1))
    served, requests = hub.file_gets(), len(hub.log)
    reads.clear()
    assert _fetch(hub, tmp_path) == first  # the branch is pinned locally: no request at all
    assert len(hub.log) == requests and not reads
    assert _fetch(hub, tmp_path, refresh=True) == first  # asks where main is now, downloads nothing
    asked = [r.path for r in hub.log[requests:]]
    assert len(asked) == 1 and asked[0].startswith("/api/models/org/tiny-lm")
    assert "/tree/" not in asked[0]
    assert hub.file_gets() == served and not reads


def test_an_unsupported_model_is_refused_before_any_weight_request(revisions, tmp_path):
    variants = {
        "arch": (
            {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"},
            "unsupported architecture",
        ),
        "quant": (
            {"quantization_config": {"quant_method": "awq", "bits": 4}},
            "quantization_config",
        ),
        "rope": (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "rope type",
        ),
    }
    with FakeHub() as hub:
        for name, (change, words) in variants.items():
            files = dict(revisions[1])
            config = {**json.loads(files["config.json"]), **change}
            files["config.json"] = json.dumps(config).encode()
            hub.repos[f"org/{name}"] = repo = FakeRepo()
            repo.add_commit(files)
            with pytest.raises(SourceError) as err:
                _fetch(hub, tmp_path, repo=f"org/{name}", token=None)
            text = _one_line_error(err)
            assert words in text and "refused before downloading its weights" in text, text
            if name == "arch":
                assert all(arch in text for arch in SUPPORTED_ARCHITECTURES)
        assert hub.requests_for(".safetensors") == []
        assert not list((tmp_path / "cache" / "snapshots").glob("*/*"))


def test_the_handler_refuses_an_unsupported_model_before_any_weight_request(revisions, tmp_path):
    files = dict(revisions[1])
    files["config.json"] = json.dumps(
        {**json.loads(files["config.json"]), "architectures": ["GPTNeoXForCausalLM"]}
    ).encode()
    with FakeHub() as hub:
        hub.repos["org/neox"] = repo = FakeRepo()
        repo.add_commit(files)
        env = _env(
            HF_ENDPOINT=hub.url,
            MODEL_NAME="org/neox",
            CACHE_DIR=str(tmp_path / "cache"),
            BASE_PATH=str(tmp_path / "volume"),
            DEVICE="cpu",
        )
        env.pop("HF_TOKEN", None)
        done = subprocess.run(
            [sys.executable, "-m", "handler", "chat", "--prompt", "hi"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode != 0
        assert "unsupported architecture ['GPTNeoXForCausalLM']" in done.stderr, done.stderr[-3000:]
        assert hub.requests_for(".safetensors") == []
        assert hub.requests_for("config.json")


def test_consolidated_weights_beside_the_indexed_shards_are_not_downloaded(revisions, tmp_path):
    files = {**revisions[1], "consolidated.safetensors": b"\0" * 4096, "params.json": b"{}"}
    with FakeHub() as hub:
        hub.repos["mistralai/tiny"] = repo = FakeRepo()
        repo.add_commit(files)
        path = _fetch(hub, tmp_path, repo="mistralai/tiny", token=None)
        assert not (path / "consolidated.safetensors").exists()
        assert hub.requests_for("consolidated.safetensors") == []
        shards = set(json.loads(files["model.safetensors.index.json"])["weight_map"].values())
        assert {r.file for r in hub.requests_for(".safetensors")} == shards


def test_a_gated_repo_needs_a_granted_token_and_says_so_in_one_line(revisions, tmp_path):
    granted = "hf_GrantedTokenAlsoSecret11"
    with FakeHub(token=TOKEN) as hub:
        hub.tokens.add(granted)
        hub.repos["meta/gated"] = repo = FakeRepo(gated=True, granted={granted})
        repo.add_commit(revisions[1])
        with pytest.raises(SourceError) as err:
            _fetch(hub, tmp_path, repo="meta/gated", token=None)
        text = _one_line_error(err)
        assert "gated repo" in text and "no token was given" in text and "HF_TOKEN" in text, text
        assert f"{hub.url}/meta/gated" in text and "(HTTP 401)" in text
        with pytest.raises(SourceError) as err:
            _fetch(hub, tmp_path, repo="meta/gated", token=TOKEN)
        text = _one_line_error(err)
        assert "has no access" in text and "(HTTP 403)" in text and TOKEN not in text, text
        assert hub.file_gets() == 0
        path = _fetch(hub, tmp_path, repo="meta/gated", token=granted)
        assert check_snapshot(path, "full") is None


def test_the_hubs_error_codes_become_one_line_each(hub, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    cases = {
        "org/missing": ("main", TOKEN, "repository not found", "(HTTP 404)"),
        "org/tiny-lm": (
            "no-such-branch",
            TOKEN,
            "revision 'no-such-branch' not found",
            "(HTTP 404)",
        ),
    }
    for repo, (revision, token, words, status) in cases.items():
        with pytest.raises(SourceError) as err:
            _fetch(hub, tmp_path, repo=repo, revision=revision, token=token)
        text = _one_line_error(err)
        assert words in text and status in text and repo in text, text
    # A private repo without a token: the hub says 401 RepoNotFound (it does not tell private from
    # missing).
    with pytest.raises(SourceError) as err:
        _fetch(hub, tmp_path, token=None)
    assert "repository not found" in _one_line_error(err) and "(HTTP 401)" in str(err.value)
    wrong = "hf_WrongTokenAlsoSecret77"
    with pytest.raises(SourceError) as err:
        _fetch(hub, tmp_path, token=wrong)
    text = _one_line_error(err)
    assert "org/tiny-lm" in text and "Invalid credentials" in text and "(HTTP 401)" in text
    assert wrong not in text
    assert check_snapshot(_fetch(hub, tmp_path)) is None
    assert TOKEN not in caplog.text and wrong not in caplog.text


def test_a_truncated_weight_file_is_quarantined_and_rebuilt_with_one_log_line(
    hub, revisions, tmp_path, caplog
):
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
    assert (
        len(lines) == 1 and lines[0].levelno == logging.WARNING and WEIGHTS in lines[0].getMessage()
    )
    quarantined = list((tmp_path / "cache" / ".quarantine").iterdir())
    assert len(quarantined) == 1 and (quarantined[0] / WEIGHTS).stat().st_size < len(
        revisions[1][WEIGHTS]
    )


def test_a_flipped_byte_on_disk_is_caught_only_by_full_verification(hub, revisions, tmp_path):
    path = _fetch(hub, tmp_path)
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (path / WEIGHTS).write_bytes(bytes(data))
    assert _fetch(hub, tmp_path) == path and check_snapshot(path) is None  # sizes agree
    assert "sha256" in check_snapshot(path, "full")
    assert _fetch(hub, tmp_path, verify="full") == path
    assert (path / WEIGHTS).read_bytes() == revisions[1][WEIGHTS]


@pytest.mark.parametrize("served", [WEIGHTS, "generation_config.json"])  # LFS, and not
def test_a_flipped_byte_in_a_served_file_fails_the_fetch_and_publishes_nothing(
    hub, revisions, tmp_path, served
):
    hub.corrupt_file = served
    with pytest.raises(SourceError) as err:
        _fetch(hub, tmp_path)
    text = _one_line_error(err)
    kind = "LFS sha256" if served.endswith(".safetensors") else "git blob id"
    assert f"{served} does not match the hub's listing" in text and kind in text, text
    assert "published nothing" in text
    assert not list((tmp_path / "cache" / "snapshots").glob("*/*"))
    hub.corrupt_file = None
    path = _fetch(hub, tmp_path)
    assert (path / served).read_bytes() == revisions[1][served]


def _kill_mid_download(hub, cache_dir: Path, env: dict) -> int:
    """`python -m cache fetch` of org/tiny-lm, killed (SIGKILL) once the hub holds WEIGHTS back;
    its exit status."""
    hub.stall_file = WEIGHTS
    proc = _cli(["fetch", "org/tiny-lm", "--cache-dir", str(cache_dir), "--quiet"], env)
    try:
        assert hub.stalled.wait(90), "the fetch never reached the stalled file"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    return proc.returncode


def test_a_fetch_killed_mid_download_leaves_nothing_valid_and_the_next_start_completes(
    hub, revisions, tmp_path
):
    cache_dir = tmp_path / "cache"
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    assert _kill_mid_download(hub, cache_dir, env) == -signal.SIGKILL
    assert not list((cache_dir / "snapshots").glob("*/*")), "a killed fetch published something"
    assert list((cache_dir / ".staging").iterdir()), "the fetch was not mid-download"
    hub.stall_file = None
    hub.release.set()
    proc = _cli(["fetch", "org/tiny-lm", "--cache-dir", str(cache_dir), "--quiet"], env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert hub.file_gets(WEIGHTS) == 2
    path = Path(out.strip().splitlines()[-1])
    assert check_snapshot(path, "full") is None
    assert (path / WEIGHTS).read_bytes() == revisions[1][WEIGHTS]
    assert not (path / ".cache").exists()


def test_four_processes_fetching_at_once_download_once_and_agree(hub, revisions, tmp_path):
    hub.gate_after_infos = 4  # weights are held back until all four have asked for the revision
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    procs = [
        _cli(["fetch", "org/tiny-lm", "--cache-dir", str(tmp_path / "cache"), "--quiet"], env)
        for _ in range(4)
    ]
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


def test_a_fetch_killed_while_writing_resume_metadata_completes_on_the_next_start(
    hub, revisions, tmp_path
):
    # A kill can land while the client writes a file's resume metadata: the file is left empty.
    # huggingface_hub 0.30 (make test-hub-oldest) fails the next download on one
    # (UnboundLocalError in read_download_metadata); cache.hub drops torn ones first.
    cache_dir = tmp_path / "cache"
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    _kill_mid_download(hub, cache_dir, env)
    torn = list((cache_dir / ".staging").rglob("*.metadata"))
    assert torn, "no resume metadata was written before the kill"
    for meta in torn:
        meta.write_text("")
    hub.stall_file = None
    hub.release.set()
    proc = _cli(["fetch", "org/tiny-lm", "--cache-dir", str(cache_dir), "--quiet"], env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    path = Path(out.strip().splitlines()[-1])
    assert check_snapshot(path, "full") is None
    assert (path / WEIGHTS).read_bytes() == revisions[1][WEIGHTS]
