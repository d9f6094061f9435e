"""The RunPod SDK's CPU probe, begun at process start (handler.cpu_probe): importing the real SDK
afterwards runs no second probe and reads the same answer.

The SDK's call comes from runpod/serverless/utils/rp_debugger.py (PROCESSOR at import); py-cpuinfo
runs the probe as `python .../cpuinfo.py --json` in a subprocess. Probes are counted from outside
the code under test with a CPython audit hook on `subprocess.Popen` (PEP 578).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys
probes = []
sys.addaudithook(lambda event, args: probes.append(1) if event == "subprocess.Popen"
                 and any(str(a).endswith("cpuinfo.py") for a in (args[1] or ())) else None)
if sys.argv[1] == "early":
    from handler import cpu_probe
    cpu_probe.begin()
import runpod  # noqa: F401 - the SDK asks for the CPU's brand when imported
from runpod.serverless.utils import rp_debugger
import cpuinfo
print(json.dumps({"probes": len(probes), "processor": rp_debugger.PROCESSOR,
                  "again": cpuinfo.get_cpu_info().get("brand_raw")}))
"""


def _child(mode: str) -> dict:
    pytest.importorskip("runpod")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_sdk_reads_the_early_probe_without_a_second_one():
    plain, early = _child("plain"), _child("early")
    assert plain["probes"] == 1  # the SDK's own call, as it makes it
    assert early["probes"] == 1  # begun early; the SDK's call and a later one reuse it
    assert early["processor"] == plain["processor"] == early["again"]
