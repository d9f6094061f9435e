"""`python -m handler serve` with TENSOR_PARALLEL_SIZE=2 on CPU: the server's engine process starts
its other rank itself, serves what one process serves, and when that rank dies the request in flight
fails and the server exits 1."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from child_process import children_running
from engine import LLM, SamplingParams
from serve_process import ServeProcess
from tiny_models import add_char_tokenizer, make_tiny_model

PROMPT = "".join(chr(0x100 + i) for i in (40, 41, 42, 43, 44, 45))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tp-serve-llama")
    make_tiny_model("llama", str(d))
    add_char_tokenizer(str(d))
    return str(d)


def test_serve_starts_its_ranks_and_exits_1_when_one_dies(model_dir, tmp_path):
    ref = (
        LLM(model=model_dir, dtype="float32", device="cpu", max_model_len=128)
        .generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    server = ServeProcess(
        {
            "MODEL_NAME": model_dir,
            "DEVICE": "cpu",
            "TENSOR_PARALLEL_SIZE": "2",
            "MAX_MODEL_LEN": "128",
            "CACHE_DIR": str(tmp_path / "cache"),
            "BASE_PATH": str(tmp_path / "volume"),
        }
    )
    try:
        body = {
            "model": model_dir,
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        out = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).json()
        assert out["choices"][0]["text"] == ref
        (engine,) = children_running(server.proc.pid, "handler.engine_process")
        (rank1,) = children_running(engine, "warmup.ranks")

        # The next step waits for rank 1 inside a collective: the request is in flight for sure.
        os.kill(rank1, signal.SIGSTOP)
        ended: dict = {}

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST",
                    server.base_url + "/v1/completions",
                    timeout=120,
                    json={**body, "max_tokens": 100, "stream": True},
                ) as resp:
                    ended["text"] = "".join(resp.iter_text())
            except httpx.HTTPError as exc:
                ended["error"] = exc

        client = threading.Thread(target=stream)
        client.start()
        time.sleep(1.0)
        assert client.is_alive()
        os.kill(rank1, signal.SIGKILL)
        client.join(120)
        assert not client.is_alive()
        assert "error" in ended or '"error"' in ended["text"], ended  # an error, never a completion
        assert server.proc.wait(120) == 1, server.output()
    finally:
        server.stop()
