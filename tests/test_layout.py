"""The house rules of DESIGN.md, checked on the code: imports point downward, the engine reads no
environment variables, and the run path never imports transformers (far too slow to import).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# package -> the packages of ours it may import
ALLOWED = {
    "engine": {"engine", "cache"},
    "cache": {"cache"},
    "warmup": {"warmup", "engine", "cache"},
    "handler": {"handler", "engine", "cache", "warmup"},
    "scaling": {"scaling"},
    "bench": {"bench", "engine", "cache", "warmup", "handler"},
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_downward(package):
    for path in (REPO / package).rglob("*.py"):
        wrong = imported_packages(path) - ALLOWED[package]
        assert not wrong, f"{path.relative_to(REPO)} imports {sorted(wrong)}"


def test_engine_reads_no_environment_variables():
    for path in (REPO / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.id
                if isinstance(node, ast.Name)
                else ""
            )
            assert name not in ("environ", "getenv", "environb"), (
                f"{path.relative_to(REPO)}:{node.lineno}"
            )


def test_the_run_path_never_imports_transformers(smollm2_dir):
    code = (
        "import sys\n"
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM(model={smollm2_dir!r}, device='cpu', max_model_len=256)\n"
        "llm.chat([{'role': 'user', 'content': 'hi'}], SamplingParams(max_tokens=2))\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] in ('transformers', 'accelerate')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
