"""The last start's weight stream, started again first thing, before the settings are read.

A start that streamed a pack to the GPU records which stream it ran (`record`), beside its start
pages, with a fingerprint of the environment variables that chose it. The next start of the same
entry point calls `begin` before anything else: when those variables hold the same values, it
starts that stream at once, while the interpreter goes on to import and validate the settings
(pydantic) and resolve the model. The start proper then asks for its stream as it always does
(cache.device_stream.start), which adopts the early one when it is the same pack, device and start
pages, and stops it otherwise: a wrong guess costs a cancelled read, never a wrong weight.

Worth it when the disk is cold (a fresh machine, dropped caches): the stream's first reads, the
start pages, come before the settings' own imports instead of after them. With the stream, this
process's own context on that GPU begins on a thread (cache.cuda_driver.begin_primary_context), so
the driver's calls that make it run beside the settings' import; the start sequence then finds it
made.

Standard library only: `begin` runs before anything else is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping

from cache import start_pages

DEFAULT_LOCAL_CACHE = "~/.cache/coldbrew"
DEFAULT_BASE_PATH = "/runpod-volume"


def cache_dir_for(cache_dir: str | None, base_path: str) -> str:
    """The snapshot cache: CACHE_DIR, else BASE_PATH/coldbrew-cache when the volume is mounted,
    else ~/.cache/coldbrew (the settings' rule; handler.config uses this one)."""
    if cache_dir:
        return os.path.expanduser(cache_dir)
    if os.path.isdir(base_path):
        return os.path.join(base_path, "coldbrew-cache")
    return os.path.expanduser(DEFAULT_LOCAL_CACHE)


def record_path(cache_dir: str, entry: str) -> str:
    """Beside the entry point's start-page record: one per interpreter, environment and entry."""
    return start_pages.default_path(cache_dir, entry).removesuffix(".json") + ".stream.json"


def fingerprint(names: Iterable[str], env: Mapping[str, str]) -> str:
    """A hash of the named variables' values (unset and empty alike; names in any case, as the
    settings read them)."""
    upper = {str(k).upper(): v for k, v in env.items()}
    values = [[name, upper.get(name) or ""] for name in sorted(set(names))]
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()


def record(
    path: str,
    names: Iterable[str],
    env: Mapping[str, str],
    stream: dict[str, object],
    tokenizer: dict[str, object] | None = None,
) -> None:
    """Write what the next start needs to begin `stream` (start_early's arguments: model_dir, the
    device setting, start_pages, want) early; `names`: the variables whose values chose it (never
    secrets: only their names and a hash of all values are kept). `tokenizer`: the directory and
    chat template of the start's tokenizer, for the next start to load early (tokenizer_hint)."""
    names = sorted(set(names))
    body = {"names": names, "env": fingerprint(names, env), "stream": stream}
    if tokenizer is not None:
        body["tokenizer"] = tokenizer
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the next start begins its stream after the settings, as before


def _read(entry: str, env: Mapping[str, str]) -> dict | None:
    """The last start's record for `entry`, when the variables that chose it are unchanged."""
    upper = {str(k).upper(): v for k, v in env.items()}
    # DOWNLOAD_DIR: worker-vllm's name for CACHE_DIR (handler/worker_vllm_env.json)
    cache_dir = cache_dir_for(
        upper.get("CACHE_DIR") or upper.get("DOWNLOAD_DIR"),
        upper.get("BASE_PATH") or DEFAULT_BASE_PATH,
    )
    try:
        with open(record_path(cache_dir, entry)) as f:
            body = json.load(f)
        return body if body["env"] == fingerprint(body["names"], env) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tokenizer_hint(
    entry: str, env: Mapping[str, str] | None = None
) -> tuple[str, str | None] | None:
    """(directory, chat template) of the last start's tokenizer, when the variables that chose its
    stream are unchanged and the directory is still there; a guess to load early, which the start
    takes only if it resolves the same."""
    body = _read(entry, os.environ if env is None else env)
    try:
        hint = body["tokenizer"]  # type: ignore[index]
        if os.path.isdir(hint["dir"]):
            return str(hint["dir"]), hint["chat_template"]
    except (KeyError, TypeError):
        pass
    return None


def begin(entry: str, env: Mapping[str, str] | None = None) -> bool:
    """Start the stream the last start of `entry` recorded, when the variables that chose it are
    unchanged and its model directory is still there; True if a stream started. Never raises: a
    missing or unreadable record starts nothing."""
    body = _read(entry, os.environ if env is None else env)
    if body is None:
        return False
    try:
        stream = body["stream"]
        if not os.path.isdir(stream["model_dir"]):
            return False
        from cache.device_stream import cuda_ordinal, start_early

        started = start_early(
            stream["model_dir"],
            stream["device"],
            start_pages=stream["start_pages"],
            want=tuple(stream["want"]) if stream["want"] is not None else None,
        )
        ordinal = cuda_ordinal(stream["device"])
        if started and ordinal is not None:
            from cache.cuda_driver import begin_primary_context

            begin_primary_context(ordinal)
        return started
    except (OSError, ValueError, KeyError, TypeError):
        return False
