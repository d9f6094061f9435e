"""Packaging stays true to the code: the lock file pins every dependency pyproject names at a
version inside its range, and the Makefile installs from it. (The Hub listing:
tests/test_hub_listing.py; the Dockerfile: tests/test_dockerfile.py; the settings table:
tests/test_handler_config.py; the README: tests/test_readme.py.)
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
LOCK = REPO / "constraints.txt"


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, pinned = line.partition("==")
            assert sep and pinned, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = pinned
    return pins


def _requirements() -> list[Requirement]:
    named = PYPROJECT["dependencies"] + [
        r for extra in PYPROJECT["optional-dependencies"].values() for r in extra
    ]
    return [Requirement(r) for r in named]


def test_lock_pins_every_dependency_inside_pyproject_range():
    pins = _lock()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name == "torch":  # the Makefile (CPU) and the Dockerfile (CUDA) pin torch themselves
            assert name not in pins
            continue
        assert name in pins, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} is outside {req}"
        )
    assert "coldbrew" not in pins


# each outside service's client and the Makefile variable naming the oldest release its tests rerun
# with (make test-clients-oldest)
OLDEST_CLIENTS = {
    "huggingface-hub": "HF_HUB_OLDEST",
    "runpod": "RUNPOD_OLDEST",
    "boto3": "BOTO3_OLDEST",
}


def test_make_reruns_each_clients_tests_with_the_floor_pyproject_admits():
    floors = {
        canonicalize_name(req.name): spec.version
        for req in _requirements()
        for spec in req.specifier
        if spec.operator == ">="
    }
    makefile = (REPO / "Makefile").read_text()
    for name, variable in OLDEST_CLIENTS.items():
        assert f"{variable} ?= {floors[name]}\n" in makefile, (
            f"make tests {name} at another release than pyproject's floor {floors[name]}"
        )


def test_the_tests_run_with_the_locked_versions():
    """What passes here is what the lock promises: the installed dependencies are the pinned
    ones."""
    pins = _lock()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue  # an extra this environment did not install
        assert installed == pins[name], (
            f"{req.name} {installed} is installed, the lock pins {pins[name]}"
        )


def test_make_installs_from_the_lock_and_run_leaves_the_test_extra_out():
    plan = subprocess.run(
        ["make", "-n", "-B", "test", "run"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    installs = [
        line for line in plan.splitlines() if " pip install " in line and "TORCH" not in line
    ]
    assert installs and all(
        "-c constraints.txt" in line
        for line in installs
        if "torch==" not in line and "--target" not in line  # the oldest-hub check's own dir
    ), installs
    run_plan = subprocess.run(
        ["make", "-n", "-B", "run"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert "[test]" not in run_plan and "-e ." in run_plan
    help_text = subprocess.run(
        ["make", "help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    for target in ("run", "serve", "test", "lock", "gpu-check", "bench", "clean"):
        assert re.search(rf"^\s+{target}\s+\S", help_text, re.M), target
