"""bench.serving_http end to end on CPU: a tiny random Llama behind `python -m handler serve`,
closed-loop clients over HTTP, the window's statistics."""

from __future__ import annotations

import json

import pytest

from test_bench_serving import TINY_LLAMA, run_bench


@pytest.mark.slow
def test_closed_loop_clients_through_the_real_server(tmp_path):
    config = tmp_path / "tiny-llama.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "out"
    args = ["--config", str(config), "--device", "cpu", "--model-root", str(tmp_path / "model")]
    args += ["--out", str(out), "--concurrency", "3", "--online-warmup", "1"]
    args += ["--online-seconds", "3", "--warmup-requests", "2", "--max-prompt", "48"]
    args += ["--max-output", "12", "--env", "MAX_NUM_BATCHED_TOKENS=64"]
    stdout = run_bench(args, module="bench.serving_http")
    result = json.loads((out / "serving_http.json").read_text())
    online = result["online"]
    assert online["error_count"] == 0, online["errors"]
    assert online["requests_finished"] > 0 and online["output_tokens"] > 0
    # every finished stream carried exactly the tokens it asked for, counted from the SSE text
    assert online["finished_lengths_as_requested"]
    assert 0 < online["ttft_ms"]["p50"] <= online["ttft_ms"]["p99"]
    assert online["output_tok_s"] == pytest.approx(online["output_tokens"] / 3, rel=0.01)
    assert result["env"]["MAX_NUM_BATCHED_TOKENS"] == "64"
    assert 0 < result["first_token_s"] < 300
    assert "python -m handler serve, 3 clients" in stdout
