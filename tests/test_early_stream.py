"""The last start's weight stream begun before the settings (cache.early_stream): which record a
process finds, when it begins the stream, and that the record keeps no secret. On a machine without
a GPU no stream can start, so what `begin` would start is observed at cache.device_stream's
start_early, and the GPU context it would begin beside it at cache.cuda_driver's
begin_primary_context; the adoption by the start proper runs on a GPU (tests/test_start_order.py).
"""

from __future__ import annotations

import json
import os

import pytest

import cache.cuda_driver as cuda_driver
import cache.device_stream as device_stream
from cache import early_stream
from handler.config import load_settings, stream_env_names


@pytest.fixture
def contexts(monkeypatch) -> list[int]:
    """The GPUs begin() would begin this process's context on (here, none is made)."""
    ordinals: list[int] = []
    monkeypatch.setattr(cuda_driver, "begin_primary_context", ordinals.append)
    return ordinals


@pytest.fixture
def started(monkeypatch, contexts) -> list[tuple]:
    """What begin() hands to start_early (which, here, starts nothing but says it did)."""
    calls: list[tuple] = []

    def start_early(model_dir, device, start_pages=None, want=None):
        calls.append((model_dir, device, start_pages, want))
        return True

    monkeypatch.setattr(device_stream, "start_early", start_early)
    return calls


def _recorded(tmp_path, env: dict[str, str], entry: str = "serve") -> dict:
    """Record a stream as a start under `env` would; returns the stream's keywords."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    cache_dir = str(load_settings(env).resolved_cache_dir())
    stream = {
        "model_dir": str(model_dir),
        "device": "auto",
        "start_pages": os.path.join(cache_dir, "start-pages", "x.json"),
        "want": ["auto", None],
    }
    early_stream.record(early_stream.record_path(cache_dir, entry), stream_env_names(), env, stream)
    return stream


@pytest.mark.parametrize(
    "spelling",
    [
        {"CACHE_DIR": "{tmp}/c"},
        {"DOWNLOAD_DIR": "{tmp}/d"},  # worker-vllm's name for it
        {"cache_dir": "{tmp}/lower"},  # the settings read names in any case
        {"BASE_PATH": "{tmp}"},
        {"BASE_PATH": "{tmp}/no-volume"},
    ],
)
def test_the_early_reader_finds_the_cache_the_settings_name(spelling, tmp_path):
    env = {k: v.format(tmp=tmp_path) for k, v in spelling.items()}
    upper = {k.upper(): v for k, v in env.items()}
    early = early_stream.cache_dir_for(
        upper.get("CACHE_DIR") or upper.get("DOWNLOAD_DIR"),
        upper.get("BASE_PATH") or early_stream.DEFAULT_BASE_PATH,
    )
    assert early == str(load_settings(env).resolved_cache_dir())


def test_an_unchanged_environment_begins_the_recorded_stream(tmp_path, started, contexts):
    env = {"CACHE_DIR": str(tmp_path / "c"), "MODEL_NAME": "org/model", "DTYPE": "bfloat16"}
    stream = _recorded(tmp_path, env)
    assert early_stream.begin("serve", env) is True
    assert started == [(stream["model_dir"], "auto", stream["start_pages"], ("auto", None))]
    assert contexts == [0]  # and the context on the stream's GPU ("auto": the first)


@pytest.mark.parametrize(("device", "ordinals"), [("cuda:1", [1]), ("cpu", [])])
def test_the_context_begins_on_the_streams_gpu_only_when_a_stream_began(
    device, ordinals, tmp_path, monkeypatch, contexts
):
    env = {"CACHE_DIR": str(tmp_path / "c"), "MODEL_NAME": "org/model"}
    stream = _recorded(tmp_path, env)
    path = early_stream.record_path(str(tmp_path / "c"), "serve")
    body = json.loads(open(path).read())
    body["stream"]["device"] = device
    with open(path, "w") as f:
        json.dump(body, f)
    began = {"value": True}
    monkeypatch.setattr(device_stream, "start_early", lambda *a, **k: began["value"])
    assert early_stream.begin("serve", env) is True
    assert contexts == ordinals
    began["value"] = False  # no stream (no driver, another process's exclusive GPU): no context
    assert early_stream.begin("serve", env) is False
    assert contexts == ordinals and os.path.isdir(stream["model_dir"])


@pytest.mark.parametrize(
    "change",
    [
        {"MODEL_NAME": "org/other"},
        {"DTYPE": "float16"},
        {"QUANTIZATION": "fp8"},
        {"CUDA_VISIBLE_DEVICES": "1"},
        {"TOKENIZER": "org/tok"},  # a worker-vllm alias of TOKENIZER_NAME
    ],
)
def test_a_changed_variable_begins_nothing(change, tmp_path, started, contexts):
    env = {"CACHE_DIR": str(tmp_path / "c"), "MODEL_NAME": "org/model", "DTYPE": "bfloat16"}
    _recorded(tmp_path, env)
    assert early_stream.begin("serve", {**env, **change}) is False
    assert started == [] and contexts == []


def test_another_entry_point_a_missing_model_or_a_torn_record_begin_nothing(tmp_path, started):
    env = {"CACHE_DIR": str(tmp_path / "c"), "MODEL_NAME": "org/model"}
    stream = _recorded(tmp_path, env, entry="worker")
    assert early_stream.begin("serve", env) is False  # each entry point has its own record
    os.rmdir(stream["model_dir"])
    assert early_stream.begin("worker", env) is False
    path = early_stream.record_path(str(tmp_path / "c"), "worker")
    with open(path, "w") as f:
        f.write('{"names": ["MODEL_NAME"], "env": ')  # cut short
    assert early_stream.begin("worker", env) is False
    assert started == []


def test_the_record_keeps_no_secret(tmp_path, started):
    token = "hf_abcdefghijklmnopqrstuvwxyz0123"
    env = {
        "CACHE_DIR": str(tmp_path / "c"),
        "MODEL_NAME": "org/model",
        "HF_TOKEN": token,
        "AWS_SECRET_ACCESS_KEY": "secret-key-value",
    }
    _recorded(tmp_path, env)
    text = open(early_stream.record_path(str(tmp_path / "c"), "serve")).read()
    names = json.loads(text)["names"]
    assert "HF_TOKEN" not in names and "AWS_SECRET_ACCESS_KEY" not in names
    assert token not in text and "secret-key-value" not in text
    # a new token alone does not change which weights stream
    assert early_stream.begin("serve", {**env, "HF_TOKEN": "hf_other"}) is True


def test_with_no_gpu_nothing_is_begun(tmp_path):
    """The real start_early on this machine: no driver, no stream."""
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    env = {"CACHE_DIR": str(tmp_path / "c"), "MODEL_NAME": "org/model"}
    _recorded(tmp_path, env)
    assert early_stream.begin("serve", env) is False
    # a context begun anyway (no driver here) ends its thread without raising
    thread = cuda_driver.begin_primary_context(0)
    thread.join(10)
    assert not thread.is_alive()


def test_a_gpus_context_is_begun_once_per_process():
    """The early stream begins the context first thing and the start proper asks again: one thread
    per device (on this machine without a driver it ends without raising)."""
    first = cuda_driver.begin_primary_context(5)
    assert cuda_driver.begin_primary_context(5) is first
    other = cuda_driver.begin_primary_context(6)
    assert other is not first
    for thread in (first, other):
        thread.join(10)
        assert not thread.is_alive()
