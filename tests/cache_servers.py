"""Loopback servers for the cache tests: a stand-in Hugging Face Hub with its LFS CDN, moto's S3
server, and the files of a tiny sharded Llama checkpoint (written with safetensors, not
transformers: the hub tests also run with the oldest huggingface_hub we admit, beside which today's
transformers does not import).

The hub answers as huggingface.co does, as huggingface_hub's own source reads it (module, function):
- Model info: GET /api/models/{repo_id}[/revision/{rev}] -> {"id", "sha", "private", "gated",
  "siblings": [{"rfilename"}], ...} (hf_api.py HfApi.model_info, ModelInfo; snapshot_download
  before 1.0 lists files from "siblings").
- The tree: GET /api/models/{repo_id}/tree/{rev}[/{path}]?recursive=&expand= -> a JSON list of
  {"type": "file", "oid", "size", "path"[, "lfs"]} and {"type": "directory", "oid", "size": 0,
  "path"}, `page_size` entries a page (the hub: 1000), the next page's URL with an opaque cursor in
  a `Link: <...>; rel="next"` header (hf_api.py list_repo_tree, RepoFile, RepoFolder, BlobLfsInfo;
  utils/_pagination.py paginate). An LFS file's "oid" is the git blob id of its *pointer* file,
  "lfs" is {"oid": the content's sha256, "size", "pointerSize"} and "size" the content's (the
  example in list_repo_tree's docstring). LFS files: the hub's default .gitattributes patterns, and
  any file of 10 MB or more.
- resolve: HEAD/GET /{repo_id}/resolve/{rev}/{path}, every answer with X-Repo-Commit. A regular
  file: 200, ETag = its git blob id, quoted; GET honours Range. An LFS file: 302 to a signed URL on
  the CDN (another origin) with ETag and X-Linked-Etag = its sha256, quoted, X-Linked-Size, and the
  body "Found. Redirecting to ..." (file_download.py get_hf_file_metadata,
  _get_metadata_or_catch_error: the metadata is read from the 302 itself, a redirect to another
  origin is not followed, and the Authorization header is dropped before downloading from it).
- Errors (utils/_http.py hf_raise_for_status): body {"error": message}, X-Error-Message, and
  X-Error-Code RepoNotFound for a missing or private repo (401 without a token, 404 with one),
  RevisionNotFound (404), EntryNotFound (404, with X-Repo-Commit), GatedRepo for a gated repo's
  files (401 without a token, 403 with a token not granted access). A gated repo's info and tree
  need no access (huggingface.js issue 945). A token the hub does not know: 401 "Invalid
  credentials in Authorization header", no error code.
- The CDN serves an LFS object to a URL with a valid signature only, and refuses a request that
  also carries an Authorization header (400), as S3 does for a presigned URL.

Not modelled: Xet storage (no X-Xet-* headers, so the client takes the LFS path), renamed repos
(relative redirects), rate limits.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

# The hub's default .gitattributes (a subset): these files go to LFS, as does any file of
# LFS_MIN_SIZE or more.
GITATTRIBUTES = b"".join(
    b"*%s filter=lfs diff=lfs merge=lfs -text\n" % s
    for s in (
        b".safetensors",
        b".bin",
        b".pt",
        b".pth",
        b".gguf",
        b".h5",
        b".msgpack",
        b".onnx",
        b".model",
    )
)
LFS_SUFFIXES = tuple(line.split()[0][1:].decode() for line in GITATTRIBUTES.splitlines())
LFS_MIN_SIZE = 10_000_000
STAMP = "2026-01-05T10:00:00.000Z"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file that git stores in place of an LFS file."""
    return b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n" % (
        hashlib.sha256(data).hexdigest().encode(),
        len(data),
    )


def is_lfs(name: str, data: bytes) -> bool:
    return name.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_SIZE


@dataclass
class FakeRepo:
    """A model repo: commits, branch/tag refs, and who may read it. private: only the hub's tokens
    see it (others get RepoNotFound); gated: anyone sees its info and tree, only tokens in `granted`
    get its files."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {path: content}
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    private: bool = False
    gated: bool = False
    granted: set[str] = field(default_factory=set)

    def add_commit(
        self, files: dict[str, bytes], *, branch: str | None = "main", seed: str = ""
    ) -> str:
        files = {".gitattributes": GITATTRIBUTES, **files}
        digests = sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())
        commit = hashlib.sha1((seed + json.dumps(digests)).encode()).hexdigest()
        self.commits[commit] = files
        if branch:
            self.refs[branch] = commit
        return commit


class Request(NamedTuple):
    server: str  # "hub" or "cdn"
    method: str
    path: str
    file: str | None  # the repo file the request is about, if any


def files_of(directory: str | Path) -> dict[str, bytes]:
    root = Path(directory)
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: "FakeHub", handler):
        super().__init__(("127.0.0.1", 0), handler)
        self.hub = hub

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeHub:
    """The stand-in hub and its CDN. token: a token the hub knows. page_size: tree entries a page.

    Test hooks: `corrupt_file` (served with its last byte flipped, size and headers unchanged),
    `stall_file` (GETs send half the bytes, then hang until `release` is set), `gate_after_infos`
    (LFS downloads wait until that many model-info requests have arrived). `log` holds every
    request, `served` the name of every file whose bytes went out, in order."""

    def __init__(self, token: str | None = None, page_size: int = 1000):
        self.tokens = {token} if token else set()
        self.page_size = page_size
        self.repos: dict[str, FakeRepo] = {}
        self.log: list[Request] = []
        self.served: list[str] = []
        self.ranges: list[str] = []  # Range headers of content GETs, in order
        self.lock = threading.Lock()
        self.corrupt_file: str | None = None
        self.stall_file: str | None = None
        self.gate_after_infos = 0
        self.infos = 0
        self.gate = threading.Event()
        self.stalled = threading.Event()
        self.release = threading.Event()
        self._secret = os.urandom(16)
        self._objects: dict[str, tuple[str, bytes]] = {}  # the CDN's: sha256 -> (name, content)
        self._hub = _Server(self, _HubHandler)
        self._cdn = _Server(self, _CdnHandler)
        self._threads = [
            threading.Thread(target=s.serve_forever, daemon=True) for s in (self._hub, self._cdn)
        ]

    @property
    def url(self) -> str:
        return self._hub.url

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.gate.set()
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def file_gets(self, name: str | None = None) -> int:
        """How many times the bytes of a file (of any file) were sent, by the hub or its CDN."""
        with self.lock:
            return sum(1 for n in self.served if name is None or n == name)

    def requests_for(self, suffix: str) -> list[Request]:
        """Every request (hub or CDN, HEAD or GET) about a file whose name ends with suffix."""
        with self.lock:
            return [r for r in self.log if r.file is not None and r.file.endswith(suffix)]

    def record(self, request: Request) -> None:
        with self.lock:
            self.log.append(request)

    def find_repo(self, repo_id: str) -> tuple[str, FakeRepo] | None:
        """Repo ids match case-insensitively, as on the hub; the canonical spelling comes back."""
        return next(((n, r) for n, r in self.repos.items() if n.lower() == repo_id.lower()), None)

    def find(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        found = self.find_repo(repo_id)
        if found is None:
            return None
        repo = found[1]
        commit = repo.refs.get(revision, revision)
        return (commit, repo.commits[commit]) if commit in repo.commits else None

    # ---- the CDN's signed URLs -------------------------------------------------------------------
    def _signature(self, path: str, expires: str) -> str:
        return hmac.new(self._secret, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def signed_url(self, name: str, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        with self.lock:
            self._objects[sha] = (name, data)
        path = f"/repos/{sha[:2]}/{sha[2:4]}/{sha}"
        expires = "4102444800"
        query = urlencode(
            {
                "response-content-disposition": f'inline; filename="{Path(name).name}";',
                "Expires": expires,
                "Signature": self._signature(path, expires),
            }
        )
        return f"{self._cdn.url}{path}?{query}"

    def cdn_object(self, path: str, query: dict) -> tuple[str, bytes] | None:
        """The object a signed CDN URL names; None when the signature does not match."""
        expected = self._signature(path, query.get("Expires", ""))
        if not hmac.compare_digest(expected, query.get("Signature", "")):
            return None
        with self.lock:
            return self._objects.get(path.rsplit("/", 1)[-1])


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    kind = ""

    def log_message(self, *args):  # keep pytest output clean
        pass

    @property
    def hub(self) -> FakeHub:
        return self.server.hub

    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    def _handle(self, head: bool) -> None:
        raise NotImplementedError

    def _record(self, file: str | None) -> None:
        self.hub.record(Request(self.kind, self.command, unquote(urlsplit(self.path).path), file))

    def _send(
        self, status: int, body: bytes = b"", headers: dict | None = None, length: int | None = None
    ) -> None:
        self.send_response(status)
        headers = {"X-Request-Id": f"Root=1-{os.urandom(12).hex()}", **(headers or {})}
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, status: int = 200, headers: dict | None = None) -> None:
        headers = {"Content-Type": "application/json; charset=utf-8", **(headers or {})}
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(
        self, status: int, code: str | None, message: str, headers: dict | None = None
    ) -> None:
        extra = {
            "X-Error-Message": message,
            **({"X-Error-Code": code} if code else {}),
            **(headers or {}),
        }
        self._json({"error": message}, status, extra)

    def _content(self, name: str, data: bytes, headers: dict) -> None:
        """A file's bytes, honouring Range (resumed downloads), with the test hooks applied."""
        hub = self.hub
        if hub.corrupt_file == name and data:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        if self.command == "HEAD":
            return self._send(200, b"", {**headers, "Accept-Ranges": "bytes"}, length=len(data))
        start, end = 0, len(data) - 1
        rng = self.headers.get("Range")
        if rng:
            with hub.lock:
                hub.ranges.append(rng)
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m is None or int(m.group(1)) >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            start, end = int(m.group(1)), min(int(m.group(2) or len(data) - 1), len(data) - 1)
        body = data[start : end + 1]
        headers = {**headers, "Accept-Ranges": "bytes"}
        if rng:
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        with hub.lock:
            hub.served.append(name)
        if hub.stall_file == name:
            self.send_response(206 if rng else 200)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            hub.stalled.set()
            hub.release.wait(60)
            self.close_connection = True
            return
        self._send(206 if rng else 200, body, headers)


def _split_repo(parts: list[str], keyword: str | None) -> tuple[str, list[str]] | None:
    """(repo_id, the parts after it) of a path where the repo id (org/name or name) is followed by
    `keyword`."""
    for n in (2, 1):
        if len(parts) > n and parts[n] == keyword or keyword is None and len(parts) == n:
            return "/".join(unquote(p) for p in parts[:n]), parts[n + 1 :] if keyword else []
    return None


class _HubHandler(_Handler):
    kind = "hub"

    def _handle(self, head: bool) -> None:
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        query = dict(parse_qsl(url.query))
        auth = self.headers.get("Authorization", "")
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        if parts[:2] == ["api", "models"]:
            tree = _split_repo(parts[2:], "tree")
            info = _split_repo(parts[2:], "revision") or _split_repo(parts[2:], None)
            self._record(None)
            if tree and tree[1]:
                under = unquote("/".join(tree[1][1:]))
                return self._tree(tree[0], unquote(tree[1][0]), under, token, query)
            if info:
                return self._info(info[0], unquote(info[1][0]) if info[1] else "main", token)
        elif (resolve := _split_repo(parts, "resolve")) and len(resolve[1]) >= 2:
            name = unquote("/".join(resolve[1][1:]))
            self._record(name)
            return self._resolve(resolve[0], unquote(resolve[1][0]), name, token)
        else:
            self._record(None)
        self._error(404, None, f"no route {url.path}")

    def _denied(self, repo_id: str, token: str | None, files: bool) -> bool:
        """Answer the error, True, when this token may not read the repo (or its files)."""
        if token is not None and token not in self.hub.tokens:
            self._error(401, None, "Invalid credentials in Authorization header")
            return True
        found = self.hub.find_repo(repo_id)
        if found is None or found[1].private and token is None:
            self._error(401 if token is None else 404, "RepoNotFound", "Repository not found")
            return True
        name, repo = found
        if files and repo.gated and token not in repo.granted:
            if token is None:
                message = (
                    f"Access to model {name} is restricted. You must have access to it "
                    "and be authenticated to access it. Please log in."
                )
            else:
                message = (
                    f"Access to model {name} is restricted and you are not in the "
                    f"authorized list. Visit {self.hub.url}/{name} to ask for access."
                )
            self._error(401 if token is None else 403, "GatedRepo", message)
            return True
        return False

    def _readable(
        self, repo_id: str, revision: str, token: str | None, files: bool
    ) -> tuple[str, dict[str, bytes]] | None:
        """(commit, files) of the revision when this token may read them, else None (answered)."""
        if self._denied(repo_id, token, files):
            return None
        found = self.hub.find(repo_id, revision)
        if found is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return found

    def _info(self, repo_id: str, revision: str, token: str | None) -> None:
        hub = self.hub
        with hub.lock:
            hub.infos += 1
            if hub.gate_after_infos and hub.infos >= hub.gate_after_infos:
                hub.gate.set()
        if (found := self._readable(repo_id, revision, token, files=False)) is None:
            return
        name, repo = hub.find_repo(repo_id)
        commit, files = found
        self._json(
            {
                "_id": hashlib.md5(name.encode()).hexdigest()[:24],
                "id": name,
                "modelId": name,
                "author": name.split("/")[0],
                "sha": commit,
                "lastModified": STAMP,
                "createdAt": STAMP,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "library_name": "transformers",
                "siblings": [{"rfilename": p} for p in sorted(files)],
            }
        )

    def _tree(
        self, repo_id: str, revision: str, under: str, token: str | None, query: dict
    ) -> None:
        if (found := self._readable(repo_id, revision, token, files=False)) is None:
            return
        commit, files = found
        recursive = query.get("recursive", "false").lower() == "true"
        entries = _tree_entries(files, under, recursive)
        if entries is None:
            return self._error(
                404,
                "EntryNotFound",
                f"{under} does not exist on {revision}",
                {"X-Repo-Commit": commit},
            )
        offset = int(base64.urlsafe_b64decode(query["cursor"]).decode()) if "cursor" in query else 0
        page = entries[offset : offset + self.hub.page_size]
        headers = {}
        if offset + self.hub.page_size < len(entries):
            cursor = base64.urlsafe_b64encode(str(offset + self.hub.page_size).encode()).decode()
            nxt = urlencode({**{k: v for k, v in query.items() if k != "cursor"}, "cursor": cursor})
            headers["Link"] = f'<{self.hub.url}{urlsplit(self.path).path}?{nxt}>; rel="next"'
        self._json(page, headers=headers)

    def _resolve(self, repo_id: str, revision: str, name: str, token: str | None) -> None:
        if (found := self._readable(repo_id, revision, token, files=True)) is None:
            return
        commit, files = found
        if name not in files:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit})
        data = files[name]
        if is_lfs(name, data):
            location = self.hub.signed_url(name, data)
            sha = f'"{hashlib.sha256(data).hexdigest()}"'
            body = f"Found. Redirecting to {location}".encode()
            return self._send(
                302,
                body,
                {
                    "Location": location,
                    "Content-Type": "text/plain; charset=utf-8",
                    "X-Repo-Commit": commit,
                    "ETag": sha,
                    "X-Linked-Etag": sha,
                    "X-Linked-Size": str(len(data)),
                },
            )
        self._content(
            name,
            data,
            {
                "X-Repo-Commit": commit,
                "ETag": f'"{git_blob_sha1(data)}"',
                "Content-Type": "application/octet-stream",
            },
        )


def _tree_entries(files: dict[str, bytes], under: str, recursive: bool) -> list[dict] | None:
    """The tree listing's entries below `under` (all levels, or one); None when `under` is not a
    directory."""
    prefix = f"{under.strip('/')}/" if under.strip("/") else ""
    dirs: set[str] = set()
    for name in files:
        parts = name.split("/")[:-1]
        dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    if prefix and prefix[:-1] not in dirs:
        return None

    def shown(path: str) -> bool:
        return path.startswith(prefix) and (recursive or "/" not in path[len(prefix) :])

    out = []
    for d in sorted(p for p in dirs if shown(p)):
        inside = json.dumps(sorted(n for n in files if n.startswith(d + "/")))
        oid = hashlib.sha1(inside.encode()).hexdigest()
        out.append({"type": "directory", "oid": oid, "size": 0, "path": d})
    for name in sorted(n for n in files if shown(n)):
        data = files[name]
        if is_lfs(name, data):
            pointer = lfs_pointer(data)
            out.append(
                {
                    "type": "file",
                    "oid": git_blob_sha1(pointer),
                    "size": len(data),
                    "path": name,
                    "lfs": {
                        "oid": hashlib.sha256(data).hexdigest(),
                        "size": len(data),
                        "pointerSize": len(pointer),
                    },
                }
            )
        else:
            out.append(
                {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}
            )
    return out


_XML = {"Content-Type": "application/xml"}


class _CdnHandler(_Handler):
    kind = "cdn"

    def _handle(self, head: bool) -> None:
        url = urlsplit(self.path)
        found = self.hub.cdn_object(url.path, dict(parse_qsl(url.query)))
        self._record(found[0] if found else None)
        if self.headers.get("Authorization"):
            return self._send(
                400,
                b"<Error><Code>InvalidArgument</Code><Message>Only one auth "
                b"mechanism allowed</Message></Error>",
                _XML,
            )
        if found is None:
            return self._send(403, b"<Error><Code>AccessDenied</Code></Error>", _XML)
        name, data = found
        if self.hub.gate_after_infos and self.command == "GET":
            self.hub.gate.wait(60)
        self._content(name, data, {"Content-Type": "binary/octet-stream"})


class S3Server:
    """moto's S3 server on a free loopback port, with a bucket; `client()` is a plain boto3 client
    for it."""

    KEY_ID = "AKIAFAKEKEYID0042"
    SECRET = "s3cr3t-Value-that-must-never-be-logged"

    def __init__(self, bucket: str = "fleet"):
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.bucket = bucket

    def __enter__(self):
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def __exit__(self, *exc):
        self.server.stop()

    def client(self):
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.KEY_ID,
            aws_secret_access_key=self.SECRET,
            region_name="us-east-1",
        )

    def options(self, **kw):
        from cache.remote import S3Options

        return S3Options(
            **{
                **dict(
                    endpoint_url=self.url,
                    access_key_id=self.KEY_ID,
                    secret_access_key=self.SECRET,
                    region="us-east-1",
                ),
                **kw,
            }
        )

    def env(self) -> dict[str, str]:
        """Environment for a subprocess: boto3 reads its credentials there."""
        return {
            "AWS_ACCESS_KEY_ID": self.KEY_ID,
            "AWS_SECRET_ACCESS_KEY": self.SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
        }


def upload_tree(s3, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)


# ---- a tiny sharded Llama checkpoint, as save_pretrained lays one out ----------------------------
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "dtype": "float32",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def _llama_tensors(cfg: dict, seed: int) -> dict:
    """Seeded random float32 tensors under HF Llama's names, in its state-dict order."""
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    layer_shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{part}.weight": s for part, s in layer_shapes.items()})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    out = {}
    for name, shape in shapes.items():
        noise = rng.standard_normal(shape)
        out[name] = (1.0 + 0.2 * noise if "norm" in name else 0.05 * noise).astype(np.float32)
    return out


def tiny_model_files(
    tmp_dir: str | Path, seed: int = 0, shard_bytes: int = 100_000
) -> dict[str, bytes]:
    """The files of a tiny random Llama in five safetensors shards of at most shard_bytes with their
    index (split as save_pretrained splits: a new shard when the next tensor would not fit), plus
    files a snapshot must leave out."""
    from safetensors.numpy import save_file

    tensors = _llama_tensors(TINY_LLAMA, seed)
    groups: list[dict] = [{}]
    for name, array in tensors.items():
        if groups[-1] and sum(a.nbytes for a in groups[-1].values()) + array.nbytes > shard_bytes:
            groups.append({})
        groups[-1][name] = array
    out = Path(tmp_dir) / f"tiny-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, group in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, shard))
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(TINY_LLAMA, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    files = files_of(out)
    files["README.md"] = b"# tiny\n"
    files["pytorch_model.bin"] = b"not a pickle, but it must not be downloaded"
    files["original/consolidated.pth"] = b"nor this"
    return files
