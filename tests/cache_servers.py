"""Loopback servers for the cache tests: a fake Hugging Face Hub (the protocol huggingface_hub's downloads use:
model info by revision, recursive tree, HEAD/GET of resolve URLs with Range and LFS headers) and moto's S3 server.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {path: content}
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit

    def add_commit(self, files: dict[str, bytes], *, branch: str | None = "main", seed: str = "") -> str:
        commit = hashlib.sha1((seed + json.dumps(sorted((k, hashlib.sha256(v).hexdigest())
                                                         for k, v in files.items()))).encode()).hexdigest()
        self.commits[commit] = dict(files)
        if branch:
            self.refs[branch] = commit
        return commit


def files_of(directory: str | Path) -> dict[str, bytes]:
    root = Path(directory)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class FakeHub(ThreadingHTTPServer):
    """The fake hub. `stall_file`: GETs of that file send half the bytes and then hang until `release` is set."""

    daemon_threads = True

    def __init__(self, token: str | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos: dict[str, FakeRepo] = {}
        self.token = token
        self.log: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.stall_file: str | None = None
        self.corrupt_file: str | None = None  # GETs of this file flip its last byte (size and headers unchanged)
        self.ranges: list[str] = []  # Range headers of file GETs, in order
        self.gate_after_infos = 0  # hold weight GETs until this many model-info requests have arrived
        self.gate = threading.Event()
        self.stalled = threading.Event()
        self.release = threading.Event()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def file_gets(self, name: str | None = None) -> int:
        """GET requests for file contents (optionally of one file name)."""
        with self.lock:
            return sum(1 for m, p in self.log
                       if m == "GET" and "/resolve/" in p and (name is None or p.endswith("/" + name)))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.shutdown()
        self.server_close()

    def find(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        repo = next((r for name, r in self.repos.items() if name.lower() == repo_id.lower()), None)
        if repo is None:
            return None
        commit = repo.refs.get(revision, revision)
        return (commit, repo.commits[commit]) if commit in repo.commits else None


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)) if "Content-Length" not in (headers or {}) else
                         headers["Content-Length"])
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _authorized(self) -> bool:
        if self.server.token and self.headers.get("Authorization") != f"Bearer {self.server.token}":
            self._json({"error": "Invalid credentials"}, 401, {"X-Error-Code": "RepoNotFound"})
            return False
        return True

    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    def _handle(self, head: bool) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        with self.server.lock:
            self.server.log.append((self.command, path))
            if self.command == "GET" and "/resolve/" in path and self.headers.get("Range"):
                self.server.ranges.append(self.headers["Range"])
            infos = sum(1 for m, p in self.server.log if p.startswith("/api/models/") and "/tree/" not in p)
            if self.server.gate_after_infos and infos >= self.server.gate_after_infos:
                self.server.gate.set()
        if not self._authorized():
            return
        m = re.fullmatch(r"/api/models/(.+)/revision/([^/]+)", path)
        if m is None and not re.fullmatch(r"/api/models/.+/tree/.+", path):
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)()", path)  # no revision: the default branch
        if m:
            found = self.server.find(m.group(1), m.group(2) or "main")
            if found is None:
                return self._json({"error": "not found"}, 404, {"X-Error-Code": "RevisionNotFound"})
            commit, files = found
            return self._json({"id": m.group(1), "sha": commit, "siblings": [{"rfilename": p} for p in files]})
        if m := re.fullmatch(r"/api/models/(.+)/tree/([^/]+)", path):
            found = self.server.find(m.group(1), m.group(2))
            if found is None:
                return self._json({"error": "not found"}, 404, {"X-Error-Code": "RevisionNotFound"})
            entries = []
            for name, data in found[1].items():
                entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
                if name.endswith(".safetensors"):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(entry)
            return self._json(entries)
        if m := re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", path):
            found = self.server.find(m.group(1), m.group(2))
            if found is None or m.group(3) not in found[1]:
                return self._json({"error": "not found"}, 404, {"X-Error-Code": "EntryNotFound"})
            commit, files = found
            data = files[m.group(3)]
            lfs = m.group(3).endswith(".safetensors")
            etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            if lfs:
                headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
            start = 0
            if (rng := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))) and not head:
                start = int(rng.group(1))
            body = data[start:]
            if self.server.corrupt_file == m.group(3) and body:
                body = body[:-1] + bytes([body[-1] ^ 0xFF])
            status = 206 if start else 200
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if head:
                return self._send(200, b"", {**headers, "Content-Length": str(len(data))}, head=True)
            if self.server.gate_after_infos and lfs:
                self.server.gate.wait(60)
            if self.server.stall_file == m.group(3):
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.server.stalled.set()
                self.server.release.wait(60)
                self.close_connection = True
                return
            return self._send(status, body, headers)
        self._json({"error": f"no route {path}"}, 404)


class S3Server:
    """moto's S3 server on a free loopback port, with a bucket; `client()` is a plain boto3 client for it."""

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

        return boto3.session.Session().client("s3", endpoint_url=self.url, aws_access_key_id=self.KEY_ID,
                                               aws_secret_access_key=self.SECRET, region_name="us-east-1")

    def options(self, **kw):
        from cache.remote import S3Options

        return S3Options(**{**dict(endpoint_url=self.url, access_key_id=self.KEY_ID, secret_access_key=self.SECRET,
                                   region="us-east-1"), **kw})

    def env(self) -> dict[str, str]:
        """Environment for a subprocess: boto3 reads its credentials there."""
        return {"AWS_ACCESS_KEY_ID": self.KEY_ID, "AWS_SECRET_ACCESS_KEY": self.SECRET,
                "AWS_DEFAULT_REGION": "us-east-1"}


def upload_tree(s3, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)


def tiny_model_files(tmp_dir: str | Path, seed: int = 0, shard: str | None = "100KB") -> dict[str, bytes]:
    """The files of a tiny random Llama saved by transformers (sharded), plus ones a snapshot must leave out."""
    from tiny_models import make_tiny_model

    out = Path(tmp_dir) / f"tiny-{seed}"
    make_tiny_model("llama", str(out), seed=seed, max_shard_size=shard)
    files = files_of(out)
    files["README.md"] = b"# tiny\n"
    files["pytorch_model.bin"] = b"not a pickle, but it must not be downloaded"
    files["original/consolidated.pth"] = b"nor this"
    return files
