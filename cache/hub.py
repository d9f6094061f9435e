"""The Hugging Face Hub source: a revision's commit, its file listing, the engine's files checked.

Files come through the real huggingface_hub client (auth, the redirect of LFS files to the CDN, its
resume metadata). Each is hashed once, in chunks, right after it arrives, and compared with the
hub's listing: the LFS sha256 for an LFS file, the git blob id otherwise. config.json (and the
weight index) come first, so check_config can refuse the model before a weight byte moves.
"""

from __future__ import annotations

import inspect
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable

from cache.redact import hide_secrets, mask, secret_value
from cache.snapshot import hash_file, list_files
from cache.sources import (
    CONFIG_FILE,
    INDEX_FILE,
    SourceError,
    check_first_files,
    is_commit,
    small_files,
    weight_files,
)

log = logging.getLogger(__name__)

DOWNLOAD_WORKERS = 8  # files in flight at once, as huggingface_hub's snapshot_download


def hub_error(
    repo_id: str,
    revision: str | None,
    endpoint: str | None,
    err: Exception,
    name: str | None = None,
) -> SourceError:
    """One line naming the repo, the revision (and file) and what the hub said, from the client's
    own error classes (huggingface_hub.errors: the same names in the oldest client we admit and the
    newest)."""
    from huggingface_hub import constants, errors

    where = (endpoint or constants.ENDPOINT).rstrip("/")
    what = f"hub {repo_id} revision {revision or 'main'}" + (f" file {name}" if name else "")
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, errors.GatedRepoError):
        who = "the token given has no access to it" if status == 403 else "no token was given"
        reason = (
            f"a gated repo and {who}: accept its conditions at {where}/{repo_id} and set "
            "HF_TOKEN to a token of that account"
        )
    elif isinstance(err, errors.RepositoryNotFoundError):
        reason = "repository not found (a private repo needs HF_TOKEN with read access to it)"
    elif isinstance(err, errors.RevisionNotFoundError):
        reason = f"revision {revision!r} not found"
    elif isinstance(err, errors.EntryNotFoundError):
        reason = "file not found"
    elif isinstance(err, errors.HfHubHTTPError):
        reason = getattr(err, "server_message", None) or str(err)
    else:
        reason = f"{type(err).__name__}: {err}"
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    reason = lines[0] if lines else type(err).__name__
    suffix = f" (HTTP {status})" if status else ""
    return SourceError(mask(f"{what} at {where}: {reason}{suffix}"))


def hub_commit(
    repo_id: str, revision: str | None, *, token: Any = None, endpoint: str | None = None
) -> str:
    """The commit hash a hub revision (branch, tag or commit) points at now."""
    from huggingface_hub import HfApi, get_token

    token = secret_value(token)
    hide_secrets(token or get_token())  # None: the client's own HF_TOKEN, hidden just the same
    if is_commit(revision):
        return revision  # type: ignore[return-value]
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision)
    except Exception as e:  # HTTP, connection, not-found, gated: all become one clear error
        raise hub_error(repo_id, revision, endpoint, e) from None
    if not info.sha:
        raise SourceError(
            f"hub {repo_id} revision {revision or 'main'}: the hub gave no commit hash"
        )
    return info.sha


def list_repo(
    repo_id: str, commit: str, *, token: str | None = None, endpoint: str | None = None
) -> dict:
    """{path: RepoFile} of every file of the repo at commit (the hub's recursive tree listing, all
    its pages): size, git blob id and, for LFS files, `lfs.sha256`."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    try:
        api = HfApi(endpoint=endpoint, token=token)
        entries = api.list_repo_tree(repo_id, revision=commit, recursive=True)
        return {e.path: e for e in entries if isinstance(e, RepoFile)}
    except Exception as e:
        raise hub_error(repo_id, commit, endpoint, e) from None


def _silent_tqdm():
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _download_options(progress: bool) -> dict:
    """hf_hub_download's progress bar off when asked (a client that takes no tqdm_class, as 0.30,
    keeps its own)."""
    from huggingface_hub import hf_hub_download

    if progress or "tqdm_class" not in inspect.signature(hf_hub_download).parameters:
        return {}
    return {"tqdm_class": _silent_tqdm()}


def verify_file(path: Path, entry, where: str) -> dict:
    """{size, sha256} of a downloaded file, read once; SourceError (the file removed) when it
    differs from its listing entry: LFS sha256 and size for an LFS file, git blob id otherwise."""
    lfs = entry.lfs
    got = hash_file(path, git_blob=lfs is None)
    if lfs is not None:
        kind, want, have, size = "LFS sha256", lfs.sha256, got["sha256"], lfs.size
    else:
        kind, want, have, size = "git blob id", entry.blob_id, got["git_sha1"], entry.size
    if have != want or got["size"] != size:
        path.unlink(missing_ok=True)
        raise SourceError(
            f"{where}: {entry.path} does not match the hub's listing "
            f"({got['size']} bytes, {kind} {have[:12]}...; the hub lists {size} "
            f"bytes, {want[:12]}...): corrupted on the way; removed it and published "
            "nothing, fetch again"
        )
    return {"size": got["size"], "sha256": got["sha256"]}


def drop_torn_resume_metadata(dest: Path) -> None:
    """Remove the client's resume metadata files that a killed fetch left torn in dest (empty, or
    short of their three lines: commit, etag, timestamp). huggingface_hub 0.30, the oldest this
    project admits, fails on one (its read_download_metadata removes the file, then reads a variable
    it never set); newer clients drop it themselves. Without its metadata the client checks the
    file against the hub again."""
    root = dest / ".cache" / "huggingface" / "download"
    for meta in root.rglob("*.metadata") if root.is_dir() else ():
        try:
            float(meta.read_text().splitlines()[2])
        except (OSError, ValueError, IndexError):
            meta.unlink(missing_ok=True)


def fetch_hub(
    repo_id: str,
    commit: str,
    dest: Path,
    *,
    token: Any = None,
    endpoint: str | None = None,
    progress: bool = True,
    check_config: Callable[[dict], Any] | None = None,
) -> dict[str, dict]:
    """Download the engine's files of repo_id at commit into dest (keeping what a killed fetch there
    completed): config.json and the weight index first (check_config(config) raises ValueError to
    refuse the model), then the tokenizer and chat-template files and exactly the shards the index
    names. Each file is checked against the hub's listing. Returns {name: {size, sha256}}."""
    import huggingface_hub as hf

    token = secret_value(token)
    hide_secrets(token or hf.get_token())  # None: the client's own HF_TOKEN, hidden just the same
    where = f"hub {repo_id}@{commit}"
    tree = list_repo(repo_id, commit, token=token, endpoint=endpoint)
    if CONFIG_FILE not in tree:
        raise SourceError(
            f"{where}: no {CONFIG_FILE} in the repo (an HF-format checkpoint is needed)"
        )
    options = _download_options(progress)
    drop_torn_resume_metadata(dest)

    def one(name: str) -> dict:
        try:
            path = hf.hf_hub_download(
                repo_id,
                name,
                revision=commit,
                local_dir=str(dest),
                token=token,
                endpoint=endpoint,
                **options,
            )
        except Exception as e:
            raise hub_error(repo_id, commit, endpoint, e, name) from None
        return verify_file(Path(path), tree[name], where)

    def download(names: list[str]) -> dict[str, dict]:
        out: dict[str, dict] = {}
        workers = max(1, min(DOWNLOAD_WORKERS, len(names)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(one, name): name for name in names}
            try:
                for future in as_completed(futures):
                    out[futures[future]] = future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        return out

    first = [n for n in (CONFIG_FILE, INDEX_FILE) if n in tree]
    files = download(first)
    index = check_first_files(dest, where, check_config)
    wanted = sorted(set(small_files(tree)) | set(weight_files(tree, index, where)))
    files.update(download([n for n in wanted if n not in files]))
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # the client's resume metadata
    for name in list_files(dest):
        if name not in files:  # left in staging by an earlier attempt, not part of this snapshot
            (dest / name).unlink()
    log.debug("%s: %d files downloaded and checked against the hub's listing", where, len(files))
    return files
