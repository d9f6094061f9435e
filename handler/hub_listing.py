"""The RunPod Hub listing: hub.json's env inputs built from handler.config.Settings, and the copies
the Hub reads.

`python -m handler.hub_listing [REPO]` rewrites REPO/hub.json's config.env from Settings (keeping
everything else), then writes .runpod/hub.json and .runpod/tests.json as copies of the root hub.json
and tests.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

from pydantic import SecretStr

from handler.config import Settings

# Hub input types beyond string/number/boolean, and inputs tucked under "advanced" in the Hub's
# form.
_HUB_TYPES = {"model_name": "huggingface", "tokenizer_name": "huggingface"}
_BASIC = {
    "model_name",
    "model_revision",
    "hf_token",
    "max_model_len",
    "gpu_memory_utilization",
    "max_concurrency",
    "default_max_tokens",
    "dtype",
    "openai_served_model_name_override",
}
# Values the image itself sets (Dockerfile ENV): the form shows them, so a deployment keeps them as
# they are.
IMAGE_ENV = {"baked_model_dir": "/opt/coldbrew/baked"}
# The files the Hub reads (its publishing guide: the .runpod directory takes precedence over the
# root).
HUB_DIR = ".runpod"
LISTING_FILES = ("hub.json", "tests.json")

_ACRONYMS = {"hf", "gpu", "kv", "s3", "aws", "url", "id", "openai", "uri"}


def _label(name: str) -> str:
    """max_model_len -> 'Max Model Len'; hf_token -> 'HF Token'."""
    return " ".join(w.upper() if w in _ACRONYMS else w.capitalize() for w in name.split("_"))


def env_entry(name: str) -> dict:
    """One hub.json env entry: key, and an input with name, type, description, default (and
    options/bounds).

    A setting without a default gets no "default" (the Hub's form then leaves the variable unset); a
    number input's default is a number, a boolean's a boolean and an option's one of its values."""
    field = Settings.model_fields[name]
    kind = field.annotation
    if get_origin(kind) is Union or isinstance(kind, UnionType):
        kind = next(a for a in get_args(kind) if a is not type(None))
    entry: dict = {"name": _label(name), "description": field.description or ""}
    if get_origin(kind) is Literal:
        entry["type"] = "string"
        entry["options"] = [{"label": str(v), "value": str(v)} for v in get_args(kind)]
    elif kind is bool:
        entry.update(type="boolean", trueValue="true", falseValue="false")
    elif kind in (int, float):
        entry["type"] = "number"
        for m in field.metadata:
            for attr, key in (("ge", "min"), ("gt", "min"), ("le", "max"), ("lt", "max")):
                if getattr(m, attr, None) is not None:
                    entry[key] = getattr(m, attr)
    else:
        entry["type"] = _HUB_TYPES.get(name, "string")
    default = IMAGE_ENV.get(name, field.default)
    if default is not None and kind is not SecretStr:
        entry["default"] = str(default) if "options" in entry else default
    if name not in _BASIC:
        entry["advanced"] = True
    return {"key": name.upper(), "input": entry}


def env_entries() -> list[dict]:
    return [env_entry(name) for name in Settings.model_fields]


def write_listing(repo: Path) -> list[Path]:
    """Regenerate repo/hub.json's env and write the .runpod copies; returns the files written."""
    hub_path = repo / "hub.json"
    hub = json.loads(hub_path.read_text())
    hub["config"]["env"] = env_entries()
    text = {
        "hub.json": json.dumps(hub, indent=2) + "\n",
        "tests.json": (repo / "tests.json").read_text(),
    }
    hub_path.write_text(text["hub.json"])
    (repo / HUB_DIR).mkdir(exist_ok=True)
    written = [hub_path]
    for name in LISTING_FILES:
        (repo / HUB_DIR / name).write_text(text[name])
        written.append(repo / HUB_DIR / name)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m handler.hub_listing",
        description="Rewrite REPO/hub.json's config.env from the worker's settings, then write the "
        "copies the RunPod Hub reads (.runpod/hub.json, .runpod/tests.json).",
    )
    parser.add_argument(
        "repo",
        nargs="?",
        default=".",
        metavar="REPO",
        help="the repository root, holding hub.json and tests.json (default: .)",
    )
    args = parser.parse_args(argv)
    repo = Path(args.repo)
    for name in ("hub.json", "tests.json"):
        if not (repo / name).is_file():
            parser.error(f"REPO: {repo} has no {name} (give the repository root)")
    for path in write_listing(repo):
        print(path)


if __name__ == "__main__":
    main()
