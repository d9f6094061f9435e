"""The start order users get: the entry modules import no torch, and in a real `python -m handler`
and `python -m handler serve` process the weights start moving (the stream process, or the
page-cache prefetch where there is no GPU) before `torch` is imported. The server's own imports
(Starlette, uvicorn) come after the weights move and before torch's import, which waits for them;
the worker never imports the RunPod SDK: a process of its own, started before the settings, does.

Observed from outside the code under test: a sitecustomize on PYTHONPATH installs a CPython audit
hook (PEP 578) that logs the interpreter's own `import` events (raised when a module is first
loaded), its `subprocess.Popen` events, and the `open` events of the prefetch's thread on weight
files; threading has no audit event, so the same file wraps threading.Thread.start to note when the
thread named "prefetch" is started. Each line carries the process id and a monotonic time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from child_process import stop
from serve_process import free_port

REPO = Path(__file__).resolve().parent.parent
WAIT_S = 120

_SITECUSTOMIZE = """
import os, sys, threading, time

_fd = os.open(os.environ["START_ORDER_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
_seen = set()
_WATCHED = {"torch", "engine.config", "starlette", "uvicorn", "runpod", "pydantic"}


def _note(event, detail):
    line = "%d\\t%.6f\\t%s\\t%s\\n" % (os.getpid(), time.monotonic(), event, detail)
    os.write(_fd, line.encode())


def _hook(event, args):
    if event == "import" and args[0] in _WATCHED and args[0] not in _seen:
        _seen.add(args[0])
        _note("import", args[0])
    elif event == "subprocess.Popen" and "cache.stream_process" in map(str, args[1] or ()):
        _note("stream_process", "")
    elif event == "subprocess.Popen" and "handler.sdk_front" in map(str, args[1] or ()):
        _note("sdk_process", "")
    elif event == "subprocess.Popen" and "handler.engine_process" in map(str, args[1] or ()):
        _note("engine_process", "")
    elif (event == "open" and "prefetch" not in _seen
          and threading.current_thread().name == "prefetch"
          and str(args[0]).endswith((".safetensors", ".cbpack"))):
        _seen.add("prefetch")
        _note("prefetch_read", args[0])


sys.addaudithook(_hook)
_thread_start = threading.Thread.start


def _start(self):
    if self.name in ("prefetch", "coldbrew-cuda-context"):
        _note(self.name + "_thread", "")
    return _thread_start(self)


threading.Thread.start = _start
"""


def _events(log: Path, pid: int | None) -> list[tuple[float, str, str]]:
    """(time, event, detail) lines the process `pid` wrote (its children's lines are left out); with
    pid None, those of every process."""
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        p, t, event, detail = line.split("\t", 3)
        if pid is None or int(p) == pid:
            out.append((float(t), event, detail))
    return out


def _python(code: str) -> str:
    """`python -c code` from the repo root: its stdout, stripped (fails the test if it fails)."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def _first(events, event: str, detail: str | None = None) -> float | None:
    return next((t for t, e, d in events if e == event and (detail is None or d == detail)), None)


def _seen(events) -> set[str]:
    """The modules imported, plus "weights" once the stream process started or the prefetch read."""
    return {
        d if e == "import" else "weights"
        for _, e, d in events
        if e in ("import", "stream_process", "prefetch_read")
    }


def _engine_pid(log: Path) -> int | None:
    """The process that imported torch and moved the weights (the entry's own, or the server's
    engine process), once one has."""
    pids = (
        {int(line.split("\t", 1)[0]) for line in log.read_text().splitlines()}
        if log.exists()
        else set()
    )
    return next((p for p in pids if {"torch", "weights"} <= _seen(_events(log, p))), None)


def _run_until(
    argv: list[str], own: str, model_dir: str, tmp_path: Path, cache_dir: Path | None = None
) -> tuple[list, list, list]:
    """Start a real entry point with the audit hook; once a process of it imported torch and read
    the weights, and it or a child of its imported `own` (or the wait runs out), stop it. Returns
    the events of the process that imported torch, the entry's own, and every process's; its output
    is in tmp_path/entry.log. cache_dir: default tmp_path/cache."""
    site = tmp_path / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    log = tmp_path / "order.log"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RUNPOD_", "MODEL_", "TOKENIZER_"))
    }
    env.update(
        MODEL_NAME=model_dir,
        CACHE_DIR=str(cache_dir or tmp_path / "cache"),
        START_ORDER_LOG=str(log),
        PYTHONPATH=os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")]),
    )
    output = tmp_path / "entry.log"
    with open(output, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "handler", *argv],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + WAIT_S
        while not (_engine_pid(log) is not None and own in _seen(_events(log, None))):
            assert proc.poll() is None, output.read_text()[-3000:]
            assert time.monotonic() < deadline, f"not all came: {_events(log, None)}"
            time.sleep(0.05)
    finally:
        stop(proc)
    return _events(log, _engine_pid(log)), _events(log, proc.pid), _events(log, None)


def test_the_servers_app_and_uvicorn_config_load_no_fastapi_websockets_or_pydantic_v1():
    # what the server builds before it listens: its routes, the app, uvicorn's loaded config
    code = (
        "import sys\n"
        "from handler.config import load_settings\n"
        "from handler.engine_boot import EngineBoot\n"
        "from handler.http_connection import uvicorn_config\n"
        "from handler.server import build_app\n"
        "settings = load_settings({})\n"
        "uvicorn_config(build_app(settings, EngineBoot(settings)), settings).load()\n"
        "heavy = ('fastapi', 'pydantic.v1', 'websockets', 'wsproto', 'torch')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    assert _python(code) == "[]"


def test_the_entry_modules_import_no_torch():
    code = (
        "import sys\n"
        "import handler.__main__, handler.worker, handler.server, handler.jobs\n"
        "import handler.engine_boot\n"
        "import warmup.start, engine.sampling_params\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n"
    )
    assert _python(code) == "[]"


def test_what_runs_before_the_weights_move_imports_no_asyncio():
    # the entry point, the SDK's process link, the settings and the start: all before the stream
    code = (
        "import sys\n"
        "import handler.__main__, handler.front_link, handler.config, handler.engine_boot\n"
        "import warmup.start\n"
        "print(sorted(m for m in ('asyncio', 'torch') if m in sys.modules))\n"
    )
    assert _python(code) == "[]"


def test_the_worker_moves_its_weights_before_torch_and_runs_the_sdk_in_its_own_process(
    smollm2_dir, tmp_path
):
    port = str(free_port())
    argv = ["--rp_serve_api", "--rp_api_host", "127.0.0.1", "--rp_api_port", port]
    engine, events, everyone = _run_until(argv, "runpod", smollm2_dir, tmp_path)
    assert engine == events, everyone  # the worker's own process runs the engine
    stream_at = _stream_start(events, smollm2_dir)
    torch_at = _first(events, "import", "torch")
    settings_at = _first(events, "import", "pydantic")  # the settings' model
    assert settings_at is not None and settings_at < stream_at < torch_at, events
    # the SDK is imported by its own process, started first thing; never by the worker's
    sdk_at = _first(events, "sdk_process")
    assert sdk_at is not None and sdk_at < settings_at, events
    assert "runpod" not in _seen(events), events
    assert _first(everyone, "import", "runpod") > sdk_at, everyone


def test_the_server_runs_its_engine_in_a_process_begun_before_its_settings(smollm2_dir, tmp_path):
    """`serve`: the engine's process is started before the server reads its settings; it moves the
    weights before it imports torch and imports neither pydantic nor Starlette; the server's process
    imports no torch at all, its own imports running beside the engine's."""
    argv = ["serve", "--host", "127.0.0.1", "--port", str(free_port())]
    engine, events, everyone = _run_until(argv, "starlette", smollm2_dir, tmp_path)
    assert engine != events, everyone
    spawned_at = _first(events, "engine_process")
    settings_at = _first(events, "import", "pydantic")
    assert spawned_at is not None and settings_at is not None and spawned_at < settings_at, events
    assert "torch" not in _seen(events) and "starlette" in _seen(events), events
    stream_at = _stream_start(engine, smollm2_dir)
    assert stream_at < _first(engine, "import", "torch"), engine
    assert not {"pydantic", "starlette", "uvicorn"} & _seen(engine), engine


def _stream_start(events, model_dir: str) -> float:
    """When the weights began to move: the stream process started, or (no GPU) the page-cache
    prefetch's thread, which then reads the model's files."""
    streams = [(t, e) for t, e, _ in events if e in ("stream_process", "prefetch_thread")]
    assert streams, events
    stream_at, kind = streams[0]
    if kind == "prefetch_thread":
        read = next((d for _, e, d in events if e == "prefetch_read"), None)
        assert read is not None, events
        assert Path(read).resolve().is_relative_to(Path(model_dir).resolve()), events
    return stream_at


@pytest.mark.gpu
def test_on_a_gpu_the_stream_process_starts_before_torch(tmp_path):
    """With a GPU and a pack (written by a first start), the weights go to the GPU from the stream
    process, which serve's engine process starts before it imports torch."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("starlette")  # the server's own dependencies (gpu-check needs only torch's)
    model_dir = str(tmp_path / "model")
    # writes the pack
    code = (
        "from tests.tiny_models import make_tiny_model\nfrom engine import LLM\n"
        f"make_tiny_model('llama', {model_dir!r})\n"
        f"LLM(model={model_dir!r}, dtype='float32', device='cuda', num_kv_blocks=16)\n"
    )
    _python(code)
    argv = ["serve", "--host", "127.0.0.1", "--port", str(free_port())]
    engine, _, _ = _run_until(argv, "starlette", model_dir, tmp_path)
    streams = [(t, e) for t, e, _ in engine if e in ("stream_process", "prefetch_thread")]
    assert streams and streams[0][1] == "stream_process", engine
    assert streams[0][0] < _first(engine, "import", "torch"), engine


@pytest.mark.gpu
def test_on_a_gpu_the_last_starts_stream_begins_before_the_settings(tmp_path):
    """A serve start that reached ready records its stream (cache.early_stream); the next start
    under the same variables: its engine process spawns that stream, and begins making its own GPU
    context, first thing, before its `import torch` (which begins before the server has sent the
    settings), and the start proper adopts the stream (one stream process). A record that names
    another GPU makes the start stop the early stream and start its own."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("starlette")
    from serve_process import ServeProcess

    model_dir, cache_dir = str(tmp_path / "model"), tmp_path / "cache"
    _python(
        "from tests.tiny_models import make_tiny_model\nfrom engine import LLM\n"
        f"make_tiny_model('llama', {model_dir!r})\n"
        f"LLM(model={model_dir!r}, dtype='float32', device='cuda', num_kv_blocks=16)\n"
    )
    first = ServeProcess({"MODEL_NAME": model_dir, "CACHE_DIR": str(cache_dir)})
    first.stop()
    records = list(cache_dir.glob("start-pages/*.stream.json"))
    assert len(records) == 1, first.output()

    argv = ["serve", "--host", "127.0.0.1", "--port", str(free_port())]
    engine, _, _ = _run_until(argv, "starlette", model_dir, tmp_path / "again", cache_dir)
    torch_at = _first(engine, "import", "torch")
    spawns = [t for t, e, _ in engine if e == "stream_process"]
    assert len(spawns) == 1 and spawns[0] < torch_at, engine
    # the engine's GPU context is made beside its imports, not after them
    contexts = [t for t, e, _ in engine if e == "coldbrew-cuda-context_thread"]
    assert len(contexts) == 1 and contexts[0] < torch_at, engine
    # the start proper (once the settings came) adopts it: seen in a start that reaches ready
    again = ServeProcess({"MODEL_NAME": model_dir, "CACHE_DIR": str(cache_dir)})
    again.stop()
    assert "the stream begun at process start is the one wanted" in again.output()

    body = json.loads(records[0].read_text())
    body["stream"]["device"] = "cuda:1"  # not what the start proper asks for: a wrong guess
    records[0].write_text(json.dumps(body))
    wrong = ServeProcess({"MODEL_NAME": model_dir, "CACHE_DIR": str(cache_dir)})
    wrong.stop()
    assert "stopped the early stream" in wrong.output()
