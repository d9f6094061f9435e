"""Triton's compiler key, computed by a second interpreter, is the one Triton computes itself.

Reference: triton.runtime.cache.triton_key's own (uncached) function, run in the same process after
the install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parent.parent

_CHECK = """
import sys
from warmup.triton_key import TritonKey
import triton.runtime.cache as tc
import triton.runtime.autotuner as at
original = tc.triton_key
w = TritonKey()
assert w.install() is True
assert tc.triton_key is not original and at.triton_key is tc.triton_key
assert tc.triton_key() == original.__wrapped__(), "the installed key differs from Triton's own"
assert TritonKey().install() is True  # a second install finds the key there and changes nothing
print("ok")
"""


def test_the_installed_key_is_tritons_own():
    out = subprocess.run(
        [sys.executable, "-c", _CHECK],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
