"""The README and docs/ stay true to the code, as a new user meets them on a fresh clone.

- Every command in the README's shell blocks is checked as written: a `make` target is one
  `make help` lists (with the Makefile's own variables); a `.venv/bin/python -m MODULE ...` command
  answers `--help` in a fresh process (this interpreter stands for `.venv/bin/python`) and knows
  every flag the README gives it; a `docker build` uses the Dockerfile's build arguments and
  secret. Nothing that needs a GPU or the network runs: `curl` lines talk to the server a block
  above starts.
- Every variable the README names exists: those of its Configuration list in Settings, the others
  in Settings, the Makefile or the code that reads them.
- Every docs/*.md page is linked from the README, and every relative link of README.md and
  docs/*.md names a file that exists (and, for a `#heading`, a heading of that file).
- The README stays short and describes the software as it is, not how it came to be.
"""

from __future__ import annotations

import functools
import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from handler.config import Settings

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
VENV_PYTHON = ".venv/bin/python"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _shell_commands() -> list[list[str]]:
    """Each command of the README's ```bash blocks as shell words (comments dropped, continuation
    lines joined)."""
    commands = []
    for lang, body in FENCE.findall(_readme()):
        if lang != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def _makefile() -> str:
    return (REPO / "Makefile").read_text(encoding="utf-8")


@functools.cache
def _make_targets() -> set[str]:
    out = subprocess.run(["make", "help"], cwd=REPO, capture_output=True, text=True, check=True)
    return set(re.findall(r"^\s+([a-z][a-z-]*)\s+\S", out.stdout, re.MULTILINE))


def _make_variables() -> set[str]:
    return set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*[?:]?=", _makefile(), re.MULTILINE))


@functools.cache
def _code_text() -> str:
    """Every file that reads a variable: the packages' sources, the Makefile, the Dockerfile."""
    paths = [REPO / "Makefile", REPO / "Dockerfile"]
    for package in ("handler", "engine", "cache", "warmup", "scaling", "bench"):
        paths += sorted((REPO / package).rglob("*.py"))
    return "\n".join(p.read_text(encoding="utf-8") for p in paths)


def _check_variable(name: str) -> None:
    known = name in Settings.env_names() or name in _make_variables()
    assert known or re.search(rf"\b{name}\b", _code_text()), (
        f"README.md names {name}, which neither Settings, the Makefile nor the code reads"
    )


@functools.cache
def _help(module: str, args: tuple[str, ...]) -> str:
    """`python -m MODULE ARGS --help` in a fresh process, from the repository root."""
    run = subprocess.run(
        [sys.executable, "-m", module, *args, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, (
        f"python -m {module} {' '.join(args)} --help exited {run.returncode}: {run.stderr[-2000:]}"
    )
    assert run.stdout.strip(), f"python -m {module} {' '.join(args)} --help printed nothing"
    return run.stdout


def _check_python(words: list[str]) -> None:
    assert words[1:2] == ["-m"] and len(words) > 2, f"run modules with -m: {shlex.join(words)}"
    module, rest = words[2], words[3:]
    flags = [i for i, w in enumerate(rest) if w.startswith("-")]
    positionals = rest[: flags[0]] if flags else rest
    help_text = _help(module, tuple(positionals))
    for word in rest:
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            assert flag in help_text, (
                f"`{shlex.join(words)}`: {flag} is not in python -m {module} "
                f"{' '.join(positionals)} --help"
            )
        elif word.startswith("tests/"):
            assert (REPO / word).exists(), f"`{shlex.join(words)}`: no {word}"


def _check_make(words: list[str]) -> None:
    for word in words[1:]:
        if "=" in word:
            name = word.split("=", 1)[0]
            assert name in _make_variables(), f"`{shlex.join(words)}`: the Makefile has no {name}"
        else:
            assert word in _make_targets(), f"`{shlex.join(words)}`: make help lists no {word}"


def _dockerfile() -> str:
    return (REPO / "Dockerfile").read_text(encoding="utf-8")


def _check_build_arg(name: str) -> None:
    assert re.search(rf"^ARG {name}\b", _dockerfile(), re.MULTILINE), (
        f"the Dockerfile has no ARG {name}"
    )


def _check_docker(words: list[str]) -> None:
    assert words[1] == "build", f"only docker build is checked: {shlex.join(words)}"
    dockerfile = _dockerfile()
    for flag, value in itertools.pairwise(words):
        if flag == "--build-arg":
            _check_build_arg(value.split("=", 1)[0])
        elif flag == "--secret":
            secret = dict(part.split("=", 1) for part in value.split(","))["id"]
            assert f"id={secret}" in dockerfile, f"the Dockerfile mounts no secret {secret}"


def test_every_readme_command_runs_as_written():
    commands = _shell_commands()
    assert commands
    for words in commands:
        while words and re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", words[0]):
            _check_variable(words.pop(0).split("=", 1)[0])
        program = words[0]
        if program == "make":
            _check_make(words)
        elif program == VENV_PYTHON:
            _check_python(words)
        elif program == "docker":
            _check_docker(words)
        elif program == "curl":
            continue  # a request to the server a command above starts
        else:
            pytest.fail(
                f"README.md runs `{shlex.join(words)}`: python commands must use "
                f"{VENV_PYTHON} (the system python lacks the dependencies); teach this "
                "test any other program"
            )


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_every_variable_the_readme_names_exists():
    text = _readme()
    listed = set(re.findall(r"`([A-Z][A-Z0-9_]{2,})`", _section(text, "Configuration")))
    assert len(listed) >= 8, listed
    assert listed <= set(Settings.env_names()), (
        f"the Configuration list names {sorted(listed - set(Settings.env_names()))}, "
        "which are not settings (handler/config.py)"
    )
    for name in set(re.findall(r"`([A-Z][A-Z0-9_]{2,})(?:=[^`]*)?`", text)):
        _check_variable(name)
    for name in set(re.findall(r"--build-arg ([A-Z][A-Z0-9_]*)=", text)):
        _check_build_arg(name)


def _strip_code(text: str) -> str:
    return FENCE.sub("", text)


def _anchors(path: Path) -> set[str]:
    """The #fragments GitHub gives the headings of a Markdown file."""
    text = _strip_code(path.read_text(encoding="utf-8"))
    headings = re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _strip_code(path.read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_a_file_that_exists(page):
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.relative_to(REPO)} links {link}: no such file"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), (
                f"{page.relative_to(REPO)} links {link}: {path.name} has no such heading"
            )


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / link.partition("#")[0]).resolve() for link in _links(README)}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert not missing, f"README.md links no {missing}"


def test_the_readme_is_short_and_about_the_software_as_it_is():
    text = _readme()
    assert len(text.splitlines()) < 300
    words = re.findall(r"\b(issues?|sessions?|previous(?:ly)?)\b", text, re.IGNORECASE)
    assert not words, (
        f"README.md speaks of {sorted(set(words))}: it describes the software as it is"
    )
    # a figure's history (what the code measured before a change) lives in docs/performance.md and
    # bench/results/, not in the README's tables
    history = re.findall(
        r"\b(the commit before|since then|an hour earlier|earlier code|before the [a-z-]+ (?:split|"
        r"change|fix))\b",
        text,
        re.IGNORECASE,
    )
    assert not history, f"README.md tells a figure's history: {sorted(set(history))}"
