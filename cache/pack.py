"""The packed weight format: one file of named tensors, each aligned for direct I/O, plus a JSON
index and a header.

Model-agnostic (names, dtypes, shapes, bytes); written atomically, validated on read (a torn or
truncated pack is a PackError).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

# Every tensor (and the index) starts on a 4 KiB boundary, so O_DIRECT can read any of them.
ALIGNMENT = 4096
MAGIC = b"CBPACK\x00\x01"
FORMAT_VERSION = 1
SUFFIX = ".cbpack"
# magic, format version, reserved, index offset, index bytes, file size, sha256 of the index; then a
# crc32 of these
_HEADER = struct.Struct("<8sIIQQQ32s")
_HEADER_CRC = struct.Struct("<I")

# dtype name (as torch spells it) -> bytes per element
DTYPE_SIZES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
}


class PackError(ValueError):
    """The file is not a complete, valid pack: the caller rebuilds it (or loads from the source)."""


@dataclass(frozen=True)
class PackEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file, a multiple of ALIGNMENT
    nbytes: int
    group: int  # tensors of one group (e.g. one layer) become ready together


@dataclass(frozen=True)
class Pack:
    """A validated pack's index: where each tensor lies. data_offset..data_end is the aligned span
    of all tensors."""

    path: str
    entries: list[PackEntry]
    metadata: dict[str, Any]
    data_offset: int
    data_end: int
    file_size: int
    by_name: dict[str, PackEntry] = field(repr=False, default_factory=dict)

    @property
    def data_nbytes(self) -> int:
        return self.data_end - self.data_offset

    @property
    def groups(self) -> list[int]:
        return sorted({e.group for e in self.entries})


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_entry(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    if dtype not in DTYPE_SIZES:
        raise ValueError(
            f"dtype: {dtype!r} of tensor {name!r} is not one of {', '.join(DTYPE_SIZES)}"
        )
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape: {shape!r} of tensor {name!r} must be non-negative integers")
    expected = _numel(shape) * DTYPE_SIZES[dtype]
    if nbytes != expected:
        raise ValueError(
            f"nbytes: tensor {name!r} has {nbytes} bytes but {dtype}{list(shape)} needs {expected}"
        )


class PackWriter:
    """Streams tensors into a temp file beside `path`; commit() fsyncs and renames it into place.

    Use as a context manager: an exception (or a kill) before commit leaves no file at `path`.
    """

    def __init__(self, path: str, metadata: dict[str, Any] | None = None) -> None:
        self.path = os.path.abspath(path)
        self.metadata = dict(metadata or {})
        directory, base = os.path.split(self.path)
        os.makedirs(directory, exist_ok=True)
        _remove_stale_temps(directory, base)
        self.tmp_path = os.path.join(
            directory, f".{base}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
        )
        self._file = open(self.tmp_path, "wb")
        self._file.write(b"\0" * ALIGNMENT)  # the header, written last
        self._pos = ALIGNMENT
        self._entries: list[dict[str, Any]] = []
        self._names: set[str] = set()

    def add(
        self, name: str, dtype: str, shape: tuple[int, ...] | list[int], data, group: int = 0
    ) -> None:
        """Append one tensor: `data` is any buffer (bytes, memoryview, numpy array) of its raw
        bytes."""
        shape = tuple(int(d) for d in shape)
        view = memoryview(data).cast("B")
        if name in self._names:
            raise ValueError(f"name: tensor {name!r} was already added to the pack")
        _check_entry(name, dtype, shape, view.nbytes)
        self._file.write(view)
        self._entries.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": list(shape),
                "offset": self._pos,
                "nbytes": view.nbytes,
                "group": int(group),
            }
        )
        self._names.add(name)
        self._pos += view.nbytes
        self._pad()

    def _pad(self) -> None:
        pad = _align(self._pos) - self._pos
        if pad:
            self._file.write(b"\0" * pad)
            self._pos += pad

    def commit(self) -> str:
        """Write the index and the header, fsync, rename into place, fsync the directory. Returns
        the path."""
        index = json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "alignment": ALIGNMENT,
                "data_offset": ALIGNMENT,
                "data_end": self._pos,
                "metadata": self.metadata,
                "tensors": self._entries,
            },
            separators=(",", ":"),
        ).encode()
        index_offset = self._pos
        self._file.write(index)
        file_size = index_offset + len(index)
        header = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            0,
            index_offset,
            len(index),
            file_size,
            hashlib.sha256(index).digest(),
        )
        self._file.seek(0)
        self._file.write(header + _HEADER_CRC.pack(zlib.crc32(header)))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp_path, self.path)
        dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return self.path

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "PackWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _remove_stale_temps(directory: str, base: str) -> None:
    """Temp files of writers that died (SIGKILL, power loss) are never valid packs: remove those of
    dead pids.

    Only this host's temps are judged (the directory may be a network volume shared with other
    machines)."""
    prefix = f".{base}.tmp-{_host()}-"
    for name in os.listdir(directory):
        if not name.startswith(prefix):
            continue
        try:
            os.kill(int(name[len(prefix) :].split("-")[0]), 0)  # raises if no such process
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
        except (ValueError, PermissionError):
            continue


def _host() -> str:
    return "".join(c if c.isalnum() else "_" for c in os.uname().nodename) or "host"


def read_pack(path: str) -> Pack:
    """Validate the header, the index and the file size; FileNotFoundError if absent, PackError if
    invalid."""
    path = os.path.abspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEADER.size + _HEADER_CRC.size)
        if len(head) < _HEADER.size + _HEADER_CRC.size:
            raise PackError(f"pack {path}: truncated ({size} bytes, shorter than its header)")
        header, (crc,) = head[: _HEADER.size], _HEADER_CRC.unpack(head[_HEADER.size :])
        magic, version, _, index_offset, index_nbytes, file_size, index_sha = _HEADER.unpack(header)
        if magic != MAGIC:
            raise PackError(
                f"pack {path}: not a coldbrew pack (bad magic; an unfinished write leaves zeros)"
            )
        if zlib.crc32(header) != crc:
            raise PackError(f"pack {path}: header checksum mismatch")
        if version != FORMAT_VERSION:
            raise PackError(
                f"pack {path}: format version {version}, this reader knows {FORMAT_VERSION}"
            )
        if size != file_size:
            raise PackError(
                f"pack {path}: truncated or extended: {size} bytes on disk, "
                f"the header says {file_size}"
            )
        if index_offset + index_nbytes != file_size or index_offset % ALIGNMENT:
            raise PackError(
                f"pack {path}: index span {index_offset}+{index_nbytes} does not end the file"
            )
        f.seek(index_offset)
        raw = f.read(index_nbytes)
    if hashlib.sha256(raw).digest() != index_sha:
        raise PackError(f"pack {path}: index checksum mismatch")
    try:
        index = json.loads(raw)
        entries = [
            PackEntry(
                t["name"],
                t["dtype"],
                tuple(t["shape"]),
                int(t["offset"]),
                int(t["nbytes"]),
                int(t["group"]),
            )
            for t in index["tensors"]
        ]
        data_offset, data_end = int(index["data_offset"]), int(index["data_end"])
    except (ValueError, KeyError, TypeError) as e:
        raise PackError(f"pack {path}: malformed index ({e})") from None
    if data_end != index_offset or data_offset % ALIGNMENT or data_offset < _HEADER.size:
        raise PackError(
            f"pack {path}: data span {data_offset}..{data_end} disagrees with the header"
        )
    by_name: dict[str, PackEntry] = {}
    end = data_offset
    for e in entries:
        try:
            _check_entry(e.name, e.dtype, e.shape, e.nbytes)
        except ValueError as err:
            raise PackError(f"pack {path}: {err}") from None
        if (
            e.offset % ALIGNMENT
            or e.offset < end
            or e.offset + e.nbytes > data_end
            or e.name in by_name
        ):
            raise PackError(
                f"pack {path}: tensor {e.name!r} at {e.offset}+{e.nbytes} "
                "overlaps or leaves the data"
            )
        end = e.offset + e.nbytes
        by_name[e.name] = e
    return Pack(
        path, entries, dict(index.get("metadata") or {}), data_offset, data_end, file_size, by_name
    )


def shard_name(name: str, rank: int, size: int) -> str:
    """The file name of shard `rank` of `size` of the pack `name` (a pack split over the GPUs of a
    tensor-parallel engine, each GPU streaming its own file): name.cbpack ->
    name.rank<r>-of-<size>.cbpack; size 1: name itself."""
    if size == 1:
        return name
    return f"{name.removesuffix(SUFFIX)}.rank{rank}-of-{size}{SUFFIX}"


def _shard_of(name: str) -> tuple[int, int]:
    """(rank, size) of a pack file name (0, 1 for an unsplit pack)."""
    stem = name.removesuffix(SUFFIX)
    tail = stem.rsplit(".", 1)[-1] if "." in stem else ""
    rank, sep, size = tail.removeprefix("rank").partition("-of-")
    if tail.startswith("rank") and sep and rank.isdigit() and size.isdigit():
        return int(rank), int(size)
    return 0, 1


# The dtype settings (DTYPE, EngineArgs.dtype; "auto" aside) and the dtype each names, as torch
# names it and pack names carry it. The engine's dtype table is built from this one.
DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def pack_name(digest: str, dtype: str, quantization: str | None, layout_version: int) -> str:
    """A whole pack's file name: <digest>-<dtype>[-<quantization>]-v<layout>.cbpack (shard_name
    makes a rank's from it; pack_variant reads it back)."""
    quant = f"-{quantization}" if quantization is not None else ""
    return f"{digest}-{dtype}{quant}-v{layout_version}{SUFFIX}"


def pack_variant(name: str) -> tuple[str, str | None]:
    """(dtype, quantization or None) a pack's file name says (pack_name's, a rank's with
    .rank<r>-of-<n> before the suffix); ("", None) for a name not in that form."""
    stem = os.path.basename(name).removesuffix(SUFFIX).split(".", 1)[0]
    parts = stem.split("-")
    if len(parts) not in (3, 4) or not parts[-1].startswith("v"):
        return "", None
    return parts[1], parts[2] if len(parts) == 4 else None


def find_packs(
    directory: str,
    rank: int = 0,
    size: int = 1,
    want: tuple[str, str | None] | None = None,
) -> list[str]:
    """Complete-looking pack files in `directory` (no temp files), newest first: unsplit packs, or
    with size > 1 shard `rank` of `size` of split ones. want: (the dtype setting, the quantization
    setting or None), known before torch: the packs whose names match it come first (a dtype of
    "auto" matches any; an unquantized engine is matched by an unquantized pack), so that the
    stream starts with the pack the engine will load when a directory holds several (bf16 and FP8
    packs of one checkpoint)."""
    if not os.path.isdir(directory):
        return []
    paths = [
        os.path.join(directory, n)
        for n in os.listdir(directory)
        if n.endswith(SUFFIX) and not n.startswith(".") and _shard_of(n) == (rank, size)
    ]
    paths.sort(key=lambda p: os.stat(p).st_mtime_ns, reverse=True)
    if want is None:
        return paths
    dtype = DTYPE_NAMES.get(want[0])

    def matches(path: str) -> bool:
        pack_dtype, pack_quant = pack_variant(path)
        return pack_quant == want[1] and (dtype is None or pack_dtype == dtype)

    return sorted(paths, key=lambda p: not matches(p))  # stable: newest first within each
