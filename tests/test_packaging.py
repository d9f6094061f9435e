"""Packaging stays true to the code: every Settings variable is in hub.json and the README table (and nothing else),
the Hub files have the keys the Hub reads, and the Dockerfile copies paths that exist and passes real flags.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from handler.config import Settings, SettingsError, load_settings
from handler.hub_listing import env_entries
from handler.jobs import parse_job

REPO = Path(__file__).resolve().parent.parent
HUB_INPUT_TYPES = {"string", "number", "boolean", "huggingface"}


@pytest.fixture(scope="module")
def hub() -> dict:
    return json.loads((REPO / "hub.json").read_text())


@pytest.fixture(scope="module")
def hub_tests() -> dict:
    return json.loads((REPO / "tests.json").read_text())


def test_hub_json_has_the_listing_keys(hub):
    assert hub["type"] == "serverless" and hub["category"] == "language"
    assert hub["title"] and hub["description"]
    cfg = hub["config"]
    assert cfg["runsOn"] == "GPU"
    assert isinstance(cfg["containerDiskInGb"], int) and cfg["containerDiskInGb"] >= 20
    assert isinstance(cfg["gpuCount"], int) and cfg["gpuCount"] >= 1
    assert cfg["gpuIds"] and all(re.fullmatch(r"[A-Z]+_\d+(_PRO)?", g) for g in cfg["gpuIds"].split(","))
    assert cfg["allowedCudaVersions"] and all(re.fullmatch(r"\d+\.\d+", v) for v in cfg["allowedCudaVersions"])
    for entry in cfg["env"]:
        inp = entry["input"]
        assert inp["type"] in HUB_INPUT_TYPES and inp["name"] and inp["description"] and "default" in inp, entry
        for option in inp.get("options", []):
            assert set(option) == {"label", "value"}


def test_hub_env_is_exactly_the_settings(hub):
    keys = [e["key"] for e in hub["config"]["env"]]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(Settings.env_names())
    # Types, defaults, bounds and descriptions come from the code: regenerate with `python -m handler.hub_listing`.
    assert hub["config"]["env"] == env_entries()


def test_hub_presets_are_valid_settings(hub):
    for preset in hub["config"]["presets"]:
        assert preset["name"] and preset["defaults"]
        assert set(preset["defaults"]) <= set(Settings.env_names()), preset["name"]
        try:
            load_settings({k: str(v) for k, v in preset["defaults"].items()})
        except SettingsError as exc:
            pytest.fail(f"preset {preset['name']!r}: {exc}")


def test_hub_env_defaults_are_valid_settings(hub):
    env = {e["key"]: str(e["input"]["default"]).lower() if isinstance(e["input"]["default"], bool)
           else str(e["input"]["default"]) for e in hub["config"]["env"]}
    defaults = load_settings(env)
    assert defaults == load_settings({})


def test_hub_tests_are_valid_jobs(hub, hub_tests):
    assert hub_tests["tests"]
    for case in hub_tests["tests"]:
        assert case["name"] and isinstance(case["timeout"], int) and case["timeout"] > 0
        parse_job(case["input"])  # raises JobInputError naming the field
    cfg = hub_tests["config"]
    assert cfg["gpuTypeId"] and cfg["gpuCount"] >= 1
    assert {e["key"] for e in cfg["env"]} <= set(Settings.env_names())
    load_settings({e["key"]: e["value"] for e in cfg["env"]})
    assert set(cfg["allowedCudaVersions"]) <= set(hub["config"]["allowedCudaVersions"])


def _readme_table_names() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Z0-9_]+)` \|", section, flags=re.M)


def test_readme_table_is_exactly_the_settings():
    names = _readme_table_names()
    assert len(names) == len(set(names))
    assert set(names) == set(Settings.env_names())


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, flags=re.M)]


def test_dockerfile_copies_paths_that_exist_and_are_not_ignored():
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    copies = [args for op, args in _dockerfile_instructions() if op in ("COPY", "ADD")]
    assert copies
    for args in copies:
        sources = [a for a in shlex.split(args) if not a.startswith("--")][:-1]
        for src in sources:
            assert (REPO / src).exists(), f"Dockerfile copies {src}, which does not exist"
            assert src not in ignored, f"{src} is copied but .dockerignore leaves it out"
    # Every package the image needs at run time is copied (pyproject's packages the worker imports).
    copied = {Path(s).parts[0] for args in copies for s in shlex.split(args)[:-1]}
    assert {"engine", "cache", "handler", "pyproject.toml"} <= copied


def test_dockerfile_runs_the_worker_and_keeps_the_token_out_of_layers():
    ops = _dockerfile_instructions()
    assert ops[-1] == ("CMD", '["python", "-m", "handler"]')
    base = next(args for op, args in ops if op == "FROM")
    arg_defaults = dict(a.split("=", 1) for op, a in ops if op == "ARG" and "=" in a)
    base = re.sub(r"\$\{(\w+)\}", lambda m: arg_defaults.get(m.group(1), ""), base)
    assert re.match(r"nvidia/cuda:12\.8\.\d+-\S*runtime", base), base  # a CUDA hub.json allows
    for op, args in ops:
        if op in ("ENV", "ARG"):
            assert "HF_TOKEN" not in args, f"{op} {args}: the token would be stored in the image"
    runs = [args for op, args in ops if op == "RUN" and "cache fetch" in args]
    assert runs and "--mount=type=secret,id=hf_token" in runs[0]


def test_dockerfile_cache_fetch_flags_exist():
    run = next(args for op, args in _dockerfile_instructions() if op == "RUN" and "cache fetch" in args)
    flags = set(re.findall(r"(--[a-z][a-z-]+)", run.split("cache fetch", 1)[1]))
    help_text = subprocess.run([sys.executable, "-m", "cache", "fetch", "--help"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout
    assert flags and all(flag in help_text for flag in flags), (flags, help_text)


def test_dockerfile_python_snippets_name_real_objects():
    """The `python -c` lines of the Dockerfile import names that exist in this tree."""
    import importlib

    for op, args in _dockerfile_instructions():
        for snippet in re.findall(r'python -c "([^"]+)"', args):
            for module, names in re.findall(r"from ([\w.]+) import ([\w, ]+)", snippet):
                mod = importlib.import_module(module)
                for name in names.split(","):
                    assert hasattr(mod, name.strip()), f"{module}.{name.strip()}"
