"""warmup.compile_log: a kernel Triton compiles (a cache miss) is named in the log with its time; a
kernel found in the cache is only counted. Checked against Triton's own compiler (ahead of time for
sm_90, no GPU needed) with a fresh cache directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import triton_nvidia_backend

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not triton_nvidia_backend(), reason="triton without its CUDA backend (ptxas)")
def test_a_compile_is_logged_by_name_and_a_cache_hit_only_counted(tmp_path):
    script = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from warmup import compile_log

        @triton.jit
        def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

        assert compile_log.install()
        def build():
            src = ASTSource(fn=_double_kernel, signature=dict(x_ptr="*fp32", n="i32",
                            BLOCK="constexpr"), constexprs=dict(BLOCK=64))
            return triton.compile(src, target=GPUTarget("cuda", 90, 32))
        build()
        build()  # the same kernel again: from the cache
        print("counts", compile_log.counts)
        # another listener is left alone
        triton.knobs.compilation.listener = print
        print("second install", compile_log.install())
    """)
    path = tmp_path / "compile_twice.py"  # a file: Triton reads a kernel's source from it
    path.write_text(script)
    out = subprocess.run(
        [sys.executable, str(path)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path / "triton")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    compiled = [line for line in lines if line.startswith("kernels: compiled")]
    assert len(compiled) == 1, lines
    assert compiled[0].startswith("kernels: compiled _double_kernel in this process")
    assert re.search(r" in \d+\.\d\d s$", compiled[0]), compiled[0]
    assert "counts {'loaded': 1, 'compiled': 1}" in lines
    assert "second install False" in lines
