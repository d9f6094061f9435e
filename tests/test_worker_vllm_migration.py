"""A worker-vllm endpoint moved to coldbrew: worker-vllm's Hub defaults (the defaults of its
.runpod/hub.json inputs, as the Hub puts them in the environment; recorded per release in
handler/worker_vllm_env.json) start the real `python -m handler` on the embedded demo model in a
fresh process, or stop it with one line naming each variable coldbrew cannot honour.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from handler.worker_vllm_env import table

REPO = Path(__file__).resolve().parent.parent
TEST_CACHE = Path(os.environ.get("COLDBREW_TEST_CACHE", REPO / ".cache" / "test-models"))
DEMO_CACHE = TEST_CACHE / "migration-cache"  # the demo model is converted here once, then reused
WAIT_S = 300
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]


def hub_defaults(release: str) -> dict[str, str]:
    """worker-vllm's Hub defaults of one release, as environment variables."""
    return {var.name: var.hub_defaults[release] for var in table() if release in var.hub_defaults}


def cannot_honour(release: str) -> list[str]:
    """The variables whose Hub default the data file refuses (an empty value is unset)."""
    return sorted(
        var.name
        for var in table()
        if var.handling in ("accepted", "refused")
        and var.hub_defaults.get(release)
        and not var.accepts(var.hub_defaults[release])
    )


def run_worker(env: dict[str, str], job: dict) -> subprocess.CompletedProcess:
    """`python -m handler --test_input JOB` (the SDK's one-job mode) with `env` and no other
    setting than the cache directory of the demo model."""
    base = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "PYTHONPATH": str(REPO),
        "CACHE_DIR": str(DEMO_CACHE),
    }
    return subprocess.run(
        [sys.executable, "-m", "handler", "--test_input", json.dumps(job)],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


@pytest.mark.slow
@pytest.mark.parametrize("release", ["main", "v2.23"])
def test_worker_vllm_hub_defaults_start_the_worker_or_name_what_it_cannot_honour(
    release, smollm2_dir
):
    env = hub_defaults(release)
    assert "MAX_CONCURRENCY" in env and "MODEL_NAME" not in env  # the Hub has no default model
    cannot = cannot_honour(release)
    job = {"input": {"messages": MESSAGES, "sampling_params": {"temperature": 0, "max_tokens": 8}}}
    done = run_worker(env, job)
    if cannot:
        assert done.returncode != 0, done.stdout[-2000:]
        lines = [line for line in done.stderr.splitlines() if "invalid environment:" in line]
        named = sorted(line.split("invalid environment: ", 1)[1].split(":", 1)[0] for line in lines)
        assert named == cannot, done.stderr[-3000:]
        return
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # The embedded demo model is SmolLM2-135M-Instruct: the engine's greedy answer from its weights.
    ref = (
        LLM(model=smollm2_dir, max_model_len=2048, device="cpu")
        .chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8))[0]
        .outputs[0]
        .text
    )
    assert result["output"][0]["choices"][0]["tokens"] == [ref]


def test_the_current_hub_listing_is_honoured_and_v2_23_stops_only_on_chunked_prefill():
    """What the test above finds, stated: worker-vllm's current Hub defaults (MAX_MODEL_LEN=auto
    among them) all pass; v2.23's carry ENABLE_CHUNKED_PREFILL=false (coldbrew always chunks)."""
    assert hub_defaults("main")["MAX_MODEL_LEN"] == "auto"
    assert cannot_honour("main") == []
    assert cannot_honour("v2.23") == ["ENABLE_CHUNKED_PREFILL"]
