"""RunPod worker-vllm's environment variables and what coldbrew does with each
(worker_vllm_env.json): their spellings read as coldbrew's settings, and one line for each
variable that cannot be honoured. It reads the mapping it is given, never os.environ.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("worker_vllm_env.json")
HANDLINGS = ("setting", "alias", "accepted", "refused", "process-env")
# worker-vllm's boolean words (src/args_builder.py TRUE_VALUES / FALSE_VALUES).
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
# A value is quoted in an error only when short and plain: a free-form one (VLLM_EXTRA_ARGS,
# a JSON config) may carry a token or a key.
_SHOWABLE = re.compile(r"[A-Za-z0-9_.\-]{1,32}")
# The data file's accept words that stand for a set of values, in words.
_WORDS_IN_TEXT = {
    "<false>": ["false"],
    "<true>": ["true"],
    "<bool>": ["true", "false"],
    "<int>": ["a whole number"],
    "<number>": ["a number"],
    "<any>": ["any value"],
}


def _is_number(text: str) -> bool:
    try:
        number = float(text)
    except ValueError:
        return False
    return math.isfinite(number) and number >= 0


def _matches(word: str, value: str) -> bool:
    """Does `value` (stripped, lower case) fit the accept word: a literal, or <false>, <int>..."""
    checks = {
        "<any>": lambda: True,
        "<false>": lambda: value in FALSE_WORDS,
        "<true>": lambda: value in TRUE_WORDS,
        "<bool>": lambda: value in TRUE_WORDS + FALSE_WORDS,
        "<int>": lambda: value.isascii() and value.isdigit(),
        "<number>": lambda: _is_number(value),
    }
    check = checks.get(word)
    return check() if check else value == word.lower()


@dataclass(frozen=True)
class WorkerVllmVar:
    """One worker-vllm variable: where it is documented, how coldbrew handles it, and why."""

    name: str
    sources: tuple[str, ...]
    handling: str
    note: str
    target: str | None = None  # alias: the coldbrew setting it is read as
    unset: tuple[str, ...] = ()  # setting: the values worker-vllm treats as unset
    accept: tuple[str, ...] = ()  # accepted / refused: the values that pass
    # worker-vllm's Hub defaults (.runpod/hub.json), by release: "main", "v2.23".
    hub_defaults: dict[str, str] = field(default_factory=dict, hash=False)

    def accepts(self, value: str) -> bool:
        return any(_matches(word, value.strip().lower()) for word in self.accept)

    def allowed(self, code: str = "") -> str:
        """The values that pass, in words: 'unset or false', 'unset, `mp` or `uni`'."""
        words = ["unset"] + [
            text for w in self.accept for text in _WORDS_IN_TEXT.get(w, [f"{code}{w}{code}"])
        ]
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]

    def describe(self) -> str:
        """What coldbrew does with it, for docs/configuration.md."""
        if self.handling == "setting":
            return f"Honoured: {self.note}."
        if self.handling == "alias":
            return f"Read as `{self.target}`: {self.note}."
        if self.handling == "process-env":
            return f"Not read by coldbrew: {self.note}."
        if self.accept == ("<any>",):
            return f"Accepted, no effect: {self.note}."
        if self.handling == "accepted":
            return (
                f"Accepted when {self.allowed('`')}, with no effect: {self.note}. "
                "Other values stop the start."
            )
        return f"Refused unless {self.allowed('`')}: {self.note}."


@lru_cache(maxsize=1)
def table() -> tuple[WorkerVllmVar, ...]:
    """Every worker-vllm variable, in the data file's order."""
    rows = json.loads(TABLE_PATH.read_text(encoding="utf-8"))["variables"]
    return tuple(
        WorkerVllmVar(
            name=r["name"],
            sources=tuple(r["sources"]),
            handling=r["handling"],
            note=r["note"],
            target=r.get("target"),
            unset=tuple(r.get("unset", ())),
            accept=tuple(r.get("accept", ())),
            hub_defaults=dict(r.get("hub_defaults", {})),
        )
        for r in rows
    )


def _shown(value: str) -> str:
    return repr(value) if _SHOWABLE.fullmatch(value) else "a value"


def translate(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """`env` (names upper-cased) with worker-vllm's spellings read as coldbrew's: aliases
    renamed, values worker-vllm treats as unset dropped; and one problem line, naming the
    variable, for each value coldbrew cannot honour."""
    out = {str(k).upper(): v for k, v in env.items()}
    problems: list[str] = []
    for var in table():
        value = out.get(var.name)
        if value is None or value == "":  # empty counts as unset, as for every setting
            continue
        if var.handling == "setting":
            if value.strip().lower() in var.unset:
                del out[var.name]
        elif var.handling == "alias":
            del out[var.name]
            current = out.get(var.target)
            if current and current != value:
                problems.append(
                    f"{var.name}: {var.note}, and {var.target} holds another "
                    f"value; set only {var.target}"
                )
            else:
                out[var.target] = value
        elif var.handling in ("accepted", "refused") and not var.accepts(value):
            problems.append(
                f"{var.name}: {var.note}; got {_shown(value)}; allowed: {var.allowed()}"
            )
    return out, problems


def migration_table() -> str:
    """docs/configuration.md's "Migrating from worker-vllm" table."""
    lines = ["| Variable | Documented in | coldbrew |", "| --- | --- | --- |"]
    for var in table():
        text = var.describe().replace("|", "\\|")
        lines.append(f"| `{var.name}` | {', '.join(var.sources)} | {text} |")
    return "\n".join(lines) + "\n"
