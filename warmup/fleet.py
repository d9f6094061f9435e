"""The first worker shares what it compiled: in ENGINE_MODE=auto, a worker that found no matching
artifact and had to compile kernels publishes them as an artifact for the next worker, beside the
snapshot (the network volume) and to S3_CACHE_URI when set, so that worker starts compiled.

It runs on a background thread after the worker has served its first requests and is idle, once the
kernel set is compiled and loaded (warmup.ready), never on a request's path. The artifact holds
kernels only: its key names this GPU's architecture and any memory size, and workers size their KV
cache by the analytic bound as this one did.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
# past this with requests always running, publish anyway (files copied on this thread)
IDLE_WAIT_S = 60.0


def share_when_served(
    engine,
    warm,
    *,
    engine_mode: str,
    selection,
    model_dir: str,
    cache_dir: str,
    remote: str | None = None,
    s3_options=None,
    push: bool = True,
) -> threading.Thread | None:
    """Start the publishing thread when this worker may share (auto mode, no artifact used; `warm`
    is warm_kernels()'s result; it publishes only if kernels were compiled); None otherwise."""
    if engine_mode != "auto" or selection is None or selection.mode != "jit" or warm is None:
        return None
    thread = threading.Thread(
        target=_share,
        name="coldbrew-share",
        daemon=True,
        kwargs=dict(
            engine=engine,
            warm=warm,
            model_dir=model_dir,
            cache_dir=cache_dir,
            remote=remote if push else None,
            s3_options=s3_options,
        ),
    )
    thread.start()
    return thread


def wait_served(engine, poll_s: float = IDLE_POLL_S, idle_wait_s: float = IDLE_WAIT_S) -> bool:
    """Until a request has used KV blocks and then, for at most idle_wait_s, until no request runs
    or waits. False if the engine stopped first (shut down or dead): the caller lets go of it, so
    that a shut-down engine's memory can be freed."""
    while engine.stats_nowait().peak_used_blocks == 0:
        if engine.wait_stopped(poll_s):
            return False
    return wait_idle(engine, poll_s, idle_wait_s)


def wait_idle(engine, poll_s: float, max_wait_s: float) -> bool:
    """Until no request runs or waits, for at most max_wait_s; False if the engine stopped."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        stats = engine.stats_nowait()
        if stats.num_running == 0 and stats.num_waiting == 0:
            break
        if engine.wait_stopped(poll_s):
            return False
    return not engine.wait_stopped(0)


def engines_root(model_dir: str, cache_dir: str) -> str:
    """Beside the snapshot when it lives in the worker's cache (the network volume the next worker
    shares), else the cache dir's engines/ (a snapshot baked into the image is no one else's)."""
    from warmup.artifacts import ENGINES_DIR

    model, cache = os.path.realpath(model_dir), os.path.realpath(cache_dir)
    if os.path.commonpath([model, cache]) == cache and os.access(model, os.W_OK):
        return os.path.join(model_dir, ENGINES_DIR)
    return os.path.join(cache_dir, ENGINES_DIR)


def _share(engine, warm, model_dir: str, cache_dir: str, remote: str | None, s3_options) -> None:
    try:
        warm.loaded.wait()
        if not warm.compiled:
            return  # nothing this worker compiled: the kernels it found are someone else's to share
        if not wait_served(engine):
            return
        path = publish_compiled(engine, warm, model_dir, cache_dir, remote, s3_options)
        log.info("fleet: shared this worker's compiled kernels as %s", path)
    except Exception as exc:  # the worker serves on; the next one compiles as this one did
        log.warning("fleet: could not share the compiled kernels: %s: %s", type(exc).__name__, exc)


def publish_compiled(
    engine, warm, model_dir: str, cache_dir: str, remote: str | None = None, s3_options=None
) -> str:
    """Stage the worker's kernels (the set, and whatever else it compiled since start) as an
    artifact and publish it once locally and, with `remote`, to S3. Returns the local artifact's
    path."""
    import torch

    from warmup.artifacts import any_memory, current_key
    from warmup.publish import publish_local, publish_remote, stage_from_cache

    core = engine.engine
    key = any_memory(current_key(core.args))
    record = {
        "kv_step_bytes": None,
        "num_kv_blocks": None,
        "graph_sizes": core.args.graph_sizes(),
        "published_by_worker": True,
        "gpu_name": torch.cuda.get_device_name(core.runner.device),
        "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    entries = set(warm.entries) | set(warm.compiled) | _new_entries(warm)
    root = engines_root(model_dir, cache_dir)
    staging = stage_from_cache(warm.cache_dir, sorted(entries), key, record, root)
    final, now = publish_local(staging, root, key, replace=False)
    if not now:
        log.info("fleet: %s was already published by another worker", final)
    if remote:
        publish_remote(final, remote, key, s3_options)
    return final


def _new_entries(warm) -> set[str]:
    """Cache entries that appeared since the warm-up began (kernels compiled on first use, outside
    the set)."""
    try:
        now = set(os.listdir(warm.cache_dir))
    except OSError:
        return set()
    return now - warm.before if warm.before is not None else set()
