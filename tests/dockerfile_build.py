"""Test helper: read the Dockerfile as Docker does, and carry out its build steps without a Docker
daemon.

Parsing follows the Dockerfile reference: `\\`-newline joins lines, `#` lines are comments, `FROM
image AS name` opens a stage, ARG values feed RUN's environment, ENV/WORKDIR/COPY expand $VAR,
${VAR}, ${VAR:-x} and ${VAR:+x}. `Build` runs a stage's instructions on this machine: the
Dockerfile's paths under /opt/ (the image's own files) are read as paths under a scratch root, RUN
goes to /bin/sh -c as in a Linux image, COPY copies from the build context (less .dockerignore) or
an earlier stage. The deviations are its arguments: the system-package RUN (apt-get) is skipped, and
`env` overrides ENV/ARG values (a CPU torch instead of the CUDA one, pip's cache allowed).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTAINER_PREFIX = "/opt/"


@dataclass
class Instruction:
    op: str
    args: str
    # --from=..., --mount=... (repeated: joined by newlines)
    flags: dict[str, str] = field(default_factory=dict)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions in order: continuation lines joined, comments and blank lines
    dropped."""
    out: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment line inside a continued instruction is removed
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1]
            continue
        pending += line
        op, _, rest = pending.strip().partition(" ")
        flags: dict[str, str] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            name, _, value = flag[2:].partition("=")
            flags[name] = f"{flags[name]}\n{value}" if name in flags else value
            rest = rest.strip()
        out.append(Instruction(op.upper(), rest, flags))
        pending = ""
    return out


def stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults (those before the first FROM) and the stages."""
    global_args: dict[str, str] = {}
    found: list[Stage] = []
    for ins in instructions(text):
        if ins.op == "FROM":
            parts = ins.args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            found.append(Stage(parts[0], name))
        elif not found:
            assert ins.op == "ARG", f"only ARG may come before FROM, got {ins.op}"
            key, _, value = ins.args.partition("=")
            global_args[key] = value.strip('"')
        else:
            found[-1].instructions.append(ins)
    return global_args, found


_VAR = re.compile(r"\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


def expand(value: str, env: dict[str, str]) -> str:
    """Docker's variable substitution for ENV, ARG, WORKDIR, COPY and FROM."""

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        current = env.get(name, "")
        if m.group(2) == "-":
            return current or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if current else ""
        return current

    return _VAR.sub(one, value)


def key_values(args: str, env: dict[str, str]) -> dict[str, str]:
    """ENV's `KEY=VALUE ...` (or the old `KEY VALUE`) with substitution against the environment so
    far."""
    if "=" not in args.split()[0]:
        key, value = args.split(None, 1)
        return {key: expand(value, env)}
    pairs = {}
    for token in shlex.split(args, posix=False):
        key, _, value = token.partition("=")
        pairs[key] = expand(value.strip('"'), env)
    return pairs


def dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def ignored(relative: str, patterns: list[str]) -> bool:
    parts = Path(relative).parts
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        if fnmatch.fnmatch(relative, pattern) or any(fnmatch.fnmatch(p, bare) for p in parts):
            return True
    return False


class Build:
    """Carries out the stages of a Dockerfile with `root` standing for the image's /opt/."""

    def __init__(
        self,
        context: Path,
        root: Path,
        overrides: dict[str, str | None],
        base_env: dict[str, str],
        skip_run=lambda command: False,
    ):
        self.context, self.root, self.overrides, self.skip_run = context, root, overrides, skip_run
        text = (context / "Dockerfile").read_text().replace(CONTAINER_PREFIX, f"{root}/")
        self.global_args, self.stages = stages(text)
        self.patterns = dockerignore(context)
        self.base_env = base_env
        self.state: dict[str, tuple[dict[str, str], str]] = {}  # stage name -> (env, workdir)
        self.log: list[str] = []

    def run_stage(self, name: str) -> tuple[dict[str, str], str]:
        """Build the named stage (after its parent stages) and return its ENV and WORKDIR."""
        if name in self.state:
            return self.state[name]
        stage = next(s for s in self.stages if s.name == name)
        if stage.base in {s.name for s in self.stages}:
            env, workdir = self.run_stage(stage.base)
            env = dict(env)
        else:
            env, workdir = dict(self.base_env), "/"
        args: dict[str, str] = {}
        for ins in stage.instructions:
            visible = {**env, **args}
            if ins.op == "ARG":
                key, _, default = ins.args.partition("=")
                args[key] = self.overrides.get(key, expand(default.strip('"'), visible))
            elif ins.op == "ENV":
                for key, value in key_values(ins.args, visible).items():
                    env[key] = self.overrides.get(key, value)
                    if env[key] is None:  # an override of None leaves the variable out
                        del env[key]
            elif ins.op == "WORKDIR":
                workdir = expand(ins.args, visible)
                os.makedirs(workdir, exist_ok=True)
            elif ins.op == "COPY":
                self._copy(ins, visible, workdir)
            elif ins.op == "RUN":
                self._run(ins.args, {**env, **args}, workdir)
        self.state[name] = (env, workdir)
        return env, workdir

    def _copy(self, ins: Instruction, env: dict[str, str], workdir: str) -> None:
        *sources, dest = [expand(a, env) for a in shlex.split(ins.args)]
        dest = dest if dest.startswith("/") else os.path.join(workdir, dest)
        for source in sources:
            if "from" in ins.flags:
                self.run_stage(ins.flags["from"])
                src, target = Path(source), Path(dest)
            else:
                src = self.context / source
                target = Path(dest) / (src.name if dest.endswith("/") else "")
            if src.is_dir():
                shutil.copytree(src, target, dirs_exist_ok=True, ignore=self._ignore(src))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)

    def _ignore(self, src: Path):
        def skip(directory: str, names: list[str]) -> list[str]:
            if not str(directory).startswith(str(self.context)):
                return []
            base = os.path.relpath(directory, self.context)
            return [
                n for n in names if ignored(os.path.normpath(os.path.join(base, n)), self.patterns)
            ]

        return skip

    def _run(self, command: str, env: dict[str, str], workdir: str) -> None:
        if self.skip_run(command):
            self.log.append(f"skipped: {command[:60]}")
            return
        started = time.perf_counter()
        done = subprocess.run(
            ["/bin/sh", "-c", command], cwd=workdir, env=env, capture_output=True, text=True
        )
        self.log.append(
            f"$ {command[:200]} ({time.perf_counter() - started:.0f} s)\n"
            f"{done.stdout[-2000:]}{done.stderr[-4000:]}"
        )
        if done.returncode != 0:
            raise AssertionError(
                f"RUN failed ({done.returncode}): {command}\n{done.stdout[-3000:]}"
                f"\n{done.stderr[-5000:]}"
            )
