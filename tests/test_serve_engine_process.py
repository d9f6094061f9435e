"""`python -m handler serve` runs its engine in a process of its own (handler.engine_process): the
server's process answers every kind of request without ever importing torch (and its first request
without importing anything: that was done while the engine started), the engine's process
ends with the server's (a clean SIGTERM, or the server killed outright), and a model that cannot
load is reported by the server in the settings' words. Real processes, SmolLM2 on CPU; imports seen
through a CPython audit hook (PEP 578) as in tests/test_start_order.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from child_process import children_running, repo_pythonpath
from serve_process import ServeProcess

REPO = Path(__file__).resolve().parent.parent

_SITECUSTOMIZE = """
import os, sys
_fd = os.open(os.environ["IMPORT_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _hook(event, args):
    if event == "import":
        os.write(_fd, ("%d %s\\n" % (os.getpid(), args[0])).encode())


sys.addaudithook(_hook)
"""


def _imports(log: Path, pid: int) -> list[str]:
    """The modules process `pid` imported so far, in order (the audit hook's log)."""
    lines = [line.split() for line in log.read_text().splitlines()]
    return [name for who, name in lines if int(who) == pid]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            status = Path(f"/proc/{pid}/status").read_text()
            if "State:\tZ" in status:  # ended, not yet reaped by its parent
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


def test_the_server_answers_every_kind_of_request_without_importing_torch(smollm2_dir, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    log = tmp_path / "imports.log"
    server = ServeProcess(
        {
            "MODEL_NAME": smollm2_dir,
            "CACHE_DIR": str(tmp_path / "cache"),
            "IMPORT_LOG": str(log),
            "PYTHONPATH": os.pathsep.join([str(site), repo_pythonpath()]),
        }
    )
    try:
        (engine,) = children_running(server.proc.pid, "handler.engine_process")
        url = server.base_url + "/v1"
        # the first requests, a streamed completion and a chat: the server imported their modules
        # and compiled the chat template while its engine started (handler.engine_link; jinja2's
        # compile imports a codec)
        before = _imports(log, server.proc.pid)
        # the engine gives token ids: ready without a tokenizer's modules (nor a build's lock)
        assert not {"tokenizers", "jinja2", "filelock"} & set(_imports(log, engine))
        completion = {"prompt": "One, two, three,", "max_tokens": 12, "stop": [" five"]}
        with httpx.stream("POST", url + "/completions", json={**completion, "stream": True}) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        chat = {
            "model": smollm2_dir,
            "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }
        out = httpx.post(url + "/chat/completions", json=chat, timeout=120).json()
        assert out["choices"][0]["logprobs"]["content"], out
        assert _imports(log, server.proc.pid)[len(before) :] == []
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
        out = httpx.post(
            url + "/chat/completions",
            json={**chat, "max_tokens": 32, "response_format": fmt},
            timeout=120,
        ).json()
        assert out["choices"][0]["message"]["content"].startswith("{"), out
        assert (
            httpx.post(url + "/completions", json={**completion, "temperature": -1}).status_code
            == 400
        )
        metrics = httpx.get(server.base_url + "/metrics").text
        assert "coldbrew_kv_cache_blocks" in metrics or "coldbrew_" in metrics
    finally:
        assert server.stop() == 0, server.output()
    heavy = ("torch", "numpy", "llguidance")
    assert [m for m in _imports(log, server.proc.pid) if m in heavy] == []
    assert {"torch", "llguidance"} <= set(_imports(log, engine))
    assert _gone(engine, 30), "the engine's process outlived the server"


def test_the_engine_process_ends_when_the_server_is_killed(smollm2_dir, tmp_path):
    server = ServeProcess({"MODEL_NAME": smollm2_dir, "CACHE_DIR": str(tmp_path / "cache")})
    (engine,) = children_running(server.proc.pid, "handler.engine_process")
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(30)
    assert _gone(engine, 30), "the engine's process outlived a killed server"


def test_a_model_that_cannot_load_is_reported_and_the_server_exits_1(tmp_path):
    missing = tmp_path / "no-such-model"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODEL_", "TOKENIZER_"))}
    env.update(
        MODEL_NAME=str(missing), CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=repo_pythonpath()
    )
    proc = subprocess.run(
        [sys.executable, "-m", "handler", "serve", "--host", "127.0.0.1", "--port", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    wanted = f"the model failed to load: MODEL_NAME={str(missing)!r}: could not resolve the model"
    assert wanted in proc.stderr, proc.stderr
