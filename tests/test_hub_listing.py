"""The RunPod Hub listing: .runpod/hub.json and .runpod/tests.json (where the Hub reads them) are
the generated copies of the root files, both match the Hub's documented schema
(tests/hub_schema.py), every input default and preset is a valid setting of its type, and every
tests.json case passes through the real runpod SDK on the embedded demo.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from handler.config import Settings, load_settings
from handler.engine_boot import EMBEDDED_DIR_NAME
from handler.hub_listing import HUB_DIR, IMAGE_ENV, LISTING_FILES, env_entries, write_listing
from handler.jobs import parse_job
from hub_schema import CUDA_VERSIONS, HUB_SCHEMA, TESTS_SCHEMA, gpu_id_errors
from local_api import local_api, runsync

REPO = Path(__file__).resolve().parent.parent
HUB = json.loads((REPO / "hub.json").read_text())
TESTS = json.loads((REPO / "tests.json").read_text())
INPUTS = {e["key"]: e["input"] for e in HUB["config"]["env"] if "input" in e}


def _errors(schema: dict, document: dict) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in Draft202012Validator(schema).iter_errors(document)
    ]


def test_schemas_are_valid_json_schema():
    Draft202012Validator.check_schema(HUB_SCHEMA)
    Draft202012Validator.check_schema(TESTS_SCHEMA)


@pytest.mark.parametrize("folder", [".", HUB_DIR])
def test_listing_matches_the_hub_schema(folder):
    hub = json.loads((REPO / folder / "hub.json").read_text())
    tests = json.loads((REPO / folder / "tests.json").read_text())
    assert _errors(HUB_SCHEMA, hub) == []
    assert _errors(TESTS_SCHEMA, tests) == []
    assert gpu_id_errors(hub["config"]["gpuIds"]) == []
    assert (
        set(tests["config"]["allowedCudaVersions"])
        <= set(hub["config"]["allowedCudaVersions"])
        <= CUDA_VERSIONS
    )


def test_the_schema_catches_what_the_hub_refuses():
    """The schema is not vacuous: the listing's old defects and a few others are each reported."""
    broken = json.loads(json.dumps(HUB))
    broken["config"]["env"][0]["input"]["type"] = "text"
    number = next(e for e in broken["config"]["env"] if e["input"]["type"] == "number")
    number["input"]["default"] = ""  # a number input with a string default
    option = next(e for e in broken["config"]["env"] if "options" in e["input"])
    option["input"]["options"][0] = {"label": "x"}
    broken["config"]["allowedCudaVersions"] = ["12.99"]
    del broken["config"]["gpuCount"]
    paths = {e.split(":")[0] for e in _errors(HUB_SCHEMA, broken)}
    env = broken["config"]["env"]
    assert {
        "config/env/0",
        f"config/env/{env.index(number)}",
        f"config/env/{env.index(option)}",
        "config/allowedCudaVersions/0",
        "config",
    } <= paths
    assert _errors(HUB_SCHEMA, HUB) == []
    assert gpu_id_errors("ADA_24,RTX_9090,-NVIDIA GeForce RTX 9090") == [
        "'RTX_9090': not a GPU pool ID",
        "'-NVIDIA GeForce RTX 9090': not a GPU ID",
    ]


def test_hub_reads_generated_copies_of_the_root_files(tmp_path):
    assert HUB["config"]["env"] == env_entries(), "regenerate: python -m handler.hub_listing"
    for name in LISTING_FILES:
        assert json.loads((REPO / HUB_DIR / name).read_text()) == json.loads(
            (REPO / name).read_text()
        ), name
    for name in LISTING_FILES:  # the generator, run on a copy, writes exactly what is committed
        shutil.copy(REPO / name, tmp_path / name)
    written = write_listing(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(
        ["hub.json"] + [f"{HUB_DIR}/{n}" for n in LISTING_FILES]
    )
    for path in written:
        assert path.read_text() == (REPO / path.relative_to(tmp_path)).read_text(), path


def test_the_generator_command_answers_help_and_refuses_a_directory_without_the_listing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "handler.hub_listing"]
    shown = subprocess.run([*command, "--help"], capture_output=True, text=True, env=env)
    assert shown.returncode == 0 and "REPO" in shown.stdout, shown.stderr
    refused = subprocess.run([*command, str(tmp_path)], capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and f"{tmp_path} has no hub.json" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / HUB_DIR).exists()


def test_the_hub_finds_handler_dockerfile_and_readme():
    """The guide: "a handler.py, Dockerfile, and README.md file (in either the .runpod or root
    directory)"."""
    for name in ("handler.py", "Dockerfile", "README.md"):
        assert (REPO / HUB_DIR / name).is_file() or (REPO / name).is_file(), name


def test_hub_env_is_exactly_the_settings():
    keys = [e["key"] for e in HUB["config"]["env"]]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(Settings.env_names())


def _as_env(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_value(key: str, value) -> None:
    """A value the Hub's form would hold for this input: of its type, within its bounds, one of its
    options."""
    spec = INPUTS[key]
    if "options" in spec:
        assert value in [o["value"] for o in spec["options"]], (key, value)
    elif spec["type"] == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert spec.get("min", value) <= value <= spec.get("max", value), (key, value)
    elif spec["type"] == "boolean":
        assert isinstance(value, bool), (key, value)
    else:
        assert isinstance(value, str), (key, value)


def test_every_input_default_is_a_valid_setting_of_its_type():
    defaults = {key: spec["default"] for key, spec in INPUTS.items() if "default" in spec}
    for key, value in defaults.items():
        _check_value(key, value)
    settings = load_settings({k: _as_env(v) for k, v in defaults.items()})
    image = {name.upper() for name in IMAGE_ENV}
    assert settings == load_settings({k: _as_env(v) for k, v in defaults.items() if k in image})
    assert {k for k, s in INPUTS.items() if "default" not in s} == {
        n.upper()
        for n, f in Settings.model_fields.items()
        if f.default is None and n not in IMAGE_ENV
    }


def test_image_values_are_the_dockerfile_env():
    text = (REPO / "Dockerfile").read_text()
    for name, value in IMAGE_ENV.items():
        assert f"ENV {name.upper()}={value}" in text, name


def test_presets_are_valid_settings():
    for preset in HUB["config"]["presets"]:
        for key, value in preset["defaults"].items():
            _check_value(key, value) if value != "" else None  # "" leaves the variable unset
        load_settings({k: _as_env(v) for k, v in preset["defaults"].items()})


def test_tests_json_cases_are_valid_jobs_and_settings():
    for case in TESTS["tests"]:
        parse_job(case["input"])  # raises JobInputError naming the field
    assert {e["key"] for e in TESTS["config"]["env"]} <= set(Settings.env_names())
    load_settings({e["key"]: e["value"] for e in TESTS["config"]["env"]})


@pytest.mark.slow
def test_every_tests_json_case_passes_through_the_sdk_on_the_embedded_demo(smollm2_dir, tmp_path):
    """The Hub's check, here: the worker started from .runpod/handler.py with tests.json's env and
    no MODEL_NAME (the embedded demo, baked as the image bakes it) answers each case with HTTP 200
    and a completed job."""
    baked = tmp_path / "baked"
    (baked / EMBEDDED_DIR_NAME).parent.mkdir(parents=True)
    (baked / EMBEDDED_DIR_NAME).symlink_to(smollm2_dir)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RUNPOD_") and k not in Settings.env_names()
    }
    env.update({e["key"]: e["value"] for e in TESTS["config"]["env"]})
    env.update(
        BAKED_MODEL_DIR=str(baked),
        BASE_PATH=str(tmp_path / "no-volume"),
        DEVICE="cpu",
        CACHE_DIR=str(tmp_path / "cache"),
        UVICORN_LOG_LEVEL="warning",
    )
    with local_api([sys.executable, str(REPO / HUB_DIR / "handler.py")], tmp_path, env) as base:
        for case in TESTS["tests"]:
            status, answer = runsync(base, case["input"], case.get("timeout", 300_000) / 1000)
            assert status == 200 and answer["status"] == "COMPLETED", (case["name"], answer)
            outputs = answer["output"] if isinstance(answer["output"], list) else [answer["output"]]
            assert outputs, (case["name"], answer)
            assert not any(isinstance(o, dict) and "error" in o for o in outputs), (
                case["name"],
                answer,
            )
    assert not (tmp_path / "cache" / "models").exists(), (
        "the demo was converted again instead of found baked"
    )
