"""Test helper: end child processes the way the fault and shutdown tests need (a signal, a bounded
wait, a kill), run a child script until it announces that it is midway, then SIGKILL it there, and
run a script under triton's CPU interpreter, the PYTHONPATH a child of the repo gets, and a
process's children that run a given module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def repo_pythonpath() -> str:
    """PYTHONPATH for a child that runs this checkout: the repo first, then this process's own
    PYTHONPATH, where `make test-clients-oldest` puts the oldest client a run checks (a child given
    the repo alone would import the lock's client instead)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Send `sig` to a child that still runs, wait up to `timeout` s, then kill it; returns its exit
    code. A child started with `start_new_session=True` leads its own process group: whatever it
    left running in that group (the runpod SDK's heartbeat process outlives its worker) is killed
    once the child has ended."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # A group whose id is the child's pid exists only if the child started it
    # (start_new_session=True).
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.returncode


def kill_when_midway(child_script: str, marker: str = "midway") -> None:
    """Run `python -c child_script` from the repo root; once it prints `marker`, SIGKILL it (no
    clean-up runs)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", child_script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == marker
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()


# numpy >= 2.3 refuses int() of a 1-element array, which triton 3.6's interpreter uses for range()
# bounds: its tensors get an __index__ before the script runs.
_INTERPRETER_INDEX_PATCH = """
import triton.runtime.interpreter as interp
_patch = interp._patch_lang_tensor
def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interp._patch_lang_tensor = _patched
"""


def run_in_triton_interpreter(script: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c script args...` from the repo root with TRITON_INTERPRET=1 (Triton kernels run on
    the CPU, the interpreter patched for numpy >= 2.3) and the repo and tests/ importable; its
    output captured, at most 10 minutes."""
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
    )
    return subprocess.run(
        [sys.executable, "-c", _INTERPRETER_INDEX_PATCH + script, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def run_with_triton_cache(script: str, cache_dir) -> subprocess.CompletedProcess:
    """`python -c script` with the repo importable and Triton's cache in `cache_dir` (the
    ahead-of-time compile tests: a fresh cache, nothing read from another run's); its output
    captured, at most 10 minutes."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )


def children_running(parent: int, module: str) -> list[int]:
    """Pids of `parent`'s children whose command line runs `module` (read from Linux's /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        ppid = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("PPid:"))
        if ppid == parent and module.encode() in cmdline:
            found.append(int(pid))
    return found
