"""Triton's settings chosen before its first import (warmup.triton_env), and Triton's runtime set up
on a thread (engine.device_warmup.begin_triton).

References: Triton's own backend discovery through the installed distributions' entry points (run
without the setting, in a fresh interpreter); Triton's libcuda_dirs() contract (a directory that
holds libcuda.so.1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache import cuda_driver
from warmup import triton_env

REPO = Path(__file__).resolve().parent.parent

_BACKENDS = (
    "import json, triton.backends as b; "
    "print(json.dumps({k: [v.compiler.__module__, v.driver.__module__] "
    "for k, v in sorted(b.backends.items())}))"
)


def _backends(in_tree: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != triton_env.IN_TREE}
    if in_tree:
        env[triton_env.IN_TREE] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _BACKENDS], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_in_tree_discovery_finds_the_backends_the_entry_points_name():
    pytest.importorskip("triton")
    found = _backends(in_tree=True)
    assert "nvidia" in found
    assert found == _backends(in_tree=False)


def test_the_settings_leave_tritons_kernel_cache_keys_as_they_were(monkeypatch):
    """A kernel cache or compiled engine built without them still matches a start that sets them."""
    pytest.importorskip("triton")
    from triton._C.libtriton import get_cache_invalidating_env_vars

    monkeypatch.setenv(triton_env.IN_TREE, "1")
    monkeypatch.setenv(triton_env.LIBCUDA_PATH, "/usr/lib/x86_64-linux-gnu")
    invalidating = set(get_cache_invalidating_env_vars())
    assert not {triton_env.IN_TREE, triton_env.LIBCUDA_PATH} & invalidating


def _driver_at(monkeypatch, folder: str | None) -> None:
    monkeypatch.setattr(cuda_driver, "load", lambda: folder is not None)
    monkeypatch.setattr(triton_env, "driver_dir", lambda: folder)


def test_apply_sets_what_the_environment_leaves_unset(monkeypatch, tmp_path):
    _driver_at(monkeypatch, str(tmp_path))
    env: dict[str, str] = {}
    assert triton_env.apply(env) == {
        "TRITON_BACKENDS_IN_TREE": "1",
        "TRITON_LIBCUDA_PATH": str(tmp_path),
    }
    assert env == {"TRITON_BACKENDS_IN_TREE": "1", "TRITON_LIBCUDA_PATH": str(tmp_path)}


def test_apply_leaves_the_users_values(monkeypatch, tmp_path):
    _driver_at(monkeypatch, str(tmp_path))
    env = {"TRITON_BACKENDS_IN_TREE": "0", "TRITON_LIBCUDA_PATH": "/opt/mine"}
    assert triton_env.apply(env) == {}
    assert env == {"TRITON_BACKENDS_IN_TREE": "0", "TRITON_LIBCUDA_PATH": "/opt/mine"}


def test_without_a_driver_only_the_backends_setting_is_chosen(monkeypatch):
    _driver_at(monkeypatch, None)
    env: dict[str, str] = {}
    assert triton_env.apply(env) == {"TRITON_BACKENDS_IN_TREE": "1"}


def test_the_driver_directory_is_the_mapped_librarys_when_it_holds_libcuda_so_1(tmp_path):
    real = tmp_path / "drivers"
    real.mkdir()
    (real / "libcuda.so.570.86.15").write_bytes(b"")
    (real / "libcuda.so.1").symlink_to("libcuda.so.570.86.15")
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "libcuda.so.570.86.15").write_bytes(b"")
    lines = [
        "7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n",
        f"7f0000002000-7f0000003000 r--p 00000000 08:01 2 {lone}/libcuda.so.570.86.15\n",
        "7f0000004000-7f0000005000 rw-p 00000000 00:00 0 [heap]\n",
        f"7f0000006000-7f0000007000 r-xp 00000000 08:01 3 {real}/libcuda.so.570.86.15\n",
    ]
    maps = tmp_path / "maps"
    maps.write_text("".join(lines))
    assert triton_env.driver_dir(str(maps)) == str(real)
    maps.write_text("".join(lines[:3]))
    assert triton_env.driver_dir(str(maps)) is None


def test_no_runtime_setup_thread_on_cpu(tmp_path):
    from engine.config import EngineArgs
    from engine.device_warmup import begin_triton

    assert begin_triton(EngineArgs(model=str(tmp_path), device="cpu")) is None


_SETUP_THEN_LAUNCH = """
import torch, triton, triton.language as tl
from triton.backends.nvidia.compiler import get_ptxas_version
from triton.runtime.driver import driver
from engine.config import EngineArgs
from engine.device_warmup import begin_triton

thread = begin_triton(EngineArgs(model=MODEL, device="cuda"))
thread.join(120)
assert not thread.is_alive()
assert driver._active is not None, "the thread made Triton's driver"
assert get_ptxas_version.cache_info().currsize == 1, "and asked ptxas's version"

@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

x = torch.zeros(1000, device="cuda")
add_one[(8,)](x, 1000, BLOCK=128)
assert x.eq(1).all().item()
assert get_ptxas_version.cache_info().hits >= 1, "the launch's compiler key used it"
print("ok")
"""


@pytest.mark.gpu
def test_a_launch_after_the_runtime_setup_uses_what_it_made(tmp_path):
    script = tmp_path / "setup_then_launch.py"  # a file: Triton reads a kernel's source
    script.write_text(f"MODEL = {str(tmp_path)!r}\n" + _SETUP_THEN_LAUNCH)  # the setup reads none
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        ),
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
