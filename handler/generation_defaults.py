"""The model's own sampling defaults (generation_config.json), which requests that leave a field
unset take, as vLLM does by default (`--generation-config auto`)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

# generation_config.json key -> the request field it defaults (vLLM reads the same keys)
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """{request field: value} from model_dir/generation_config.json (empty when there is none); a
    value of the wrong type is left out with a warning naming it."""
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("generation_config.json unreadable, its defaults are not applied: %s", e)
        return {}
    if not isinstance(config, dict):
        return {}
    out: dict[str, Any] = {}
    for key, field in _FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            log.warning("generation_config.json: %s=%r is not a number; not applied", key, value)
            continue
        out[field] = int(value) if field == "top_k" else float(value)
    if out:
        log.info("sampling defaults from generation_config.json: %s", out)
    return out
