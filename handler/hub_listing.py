"""The RunPod Hub listing's env inputs, built from handler.config.Settings so hub.json never drifts from the code.

`python -m handler.hub_listing [hub.json]` rewrites the file's config.env from Settings and keeps everything else.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

from pydantic import SecretStr

from handler.config import Settings

# Hub input types beyond string/number/boolean, and inputs tucked under "advanced" in the Hub's form.
_HUB_TYPES = {"model_name": "huggingface", "tokenizer_name": "huggingface"}
_BASIC = {"model_name", "model_revision", "hf_token", "max_model_len", "gpu_memory_utilization", "max_concurrency",
          "default_max_tokens", "dtype", "openai_served_model_name_override"}


_ACRONYMS = {"hf", "gpu", "kv", "s3", "aws", "url", "id", "openai", "uri"}


def _label(name: str) -> str:
    """max_model_len -> 'Max Model Len'; hf_token -> 'HF Token'."""
    return " ".join(w.upper() if w in _ACRONYMS else w.capitalize() for w in name.split("_"))


def env_entry(name: str) -> dict:
    """One hub.json env entry: key, and an input with name, type, description, default (and options/bounds)."""
    field = Settings.model_fields[name]
    kind = field.annotation
    if get_origin(kind) is Union or isinstance(kind, UnionType):
        kind = next(a for a in get_args(kind) if a is not type(None))
    entry: dict = {"name": _label(name), "description": field.description or ""}
    default = field.default
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
    entry["default"] = "" if default is None or kind is SecretStr else default
    if name not in _BASIC:
        entry["advanced"] = True
    return {"key": name.upper(), "input": entry}


def env_entries() -> list[dict]:
    return [env_entry(name) for name in Settings.model_fields]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0] if argv else "hub.json")
    hub = json.loads(path.read_text())
    hub["config"]["env"] = env_entries()
    path.write_text(json.dumps(hub, indent=2) + "\n")
    print(f"{path}: {len(hub['config']['env'])} env inputs")


if __name__ == "__main__":
    main()
