"""The start path's page record: what a process mapped and imported, with its resident ranges, read
back into the page cache. References: /proc/self/maps and sys.modules of a real child process, and
mincore after the read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cache import start_pages
from cache.prefetch import resident_fraction

REPO = Path(__file__).resolve().parent.parent


def _python(code: str) -> None:
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        check=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


def _record_in_child(path: str, imports: str) -> None:
    _python(f"import {imports}; from cache.start_pages import record; record({path!r})")


def test_a_record_holds_the_mapped_libraries_and_imported_modules_with_their_pages(tmp_path):
    path = str(tmp_path / "pages.json")
    _record_in_child(path, "json, sqlite3, safetensors")
    data = json.load(open(path))
    files = {name: ranges for name, ranges in data["files"]}
    import safetensors

    # mapped: the extension module
    assert any(n.endswith(".so") and "safetensors" in n for n in files)
    import importlib.util

    pyc = importlib.util.cache_from_source(safetensors.__file__)  # imported: its bytecode was read
    assert os.path.realpath(pyc) in {os.path.realpath(n) for n in files}
    assert any("sqlite3" in n for n in files)
    for name, ranges in files.items():
        size = os.path.getsize(name)
        assert ranges and all(
            off % os.sysconf("SC_PAGE_SIZE") == 0 and n > 0 for off, n in ranges
        ), name
        assert all(off + n <= size + os.sysconf("SC_PAGE_SIZE") for off, n in ranges), name
        # sorted, merged, disjoint
        assert all(a[0] + a[1] < b[0] for a, b in zip(ranges, ranges[1:])), name
    assert data["bytes"] == sum(n for r in files.values() for _, n in r)


def test_a_mapped_file_records_the_pages_the_process_touched_not_all_it_finds_cached(tmp_path):
    big = tmp_path / "lib.so"
    big.write_bytes(os.urandom(64 << 20))  # just written: every page in the page cache
    code = (
        "import mmap, sys\n"
        "from cache import start_pages\n"
        f"f = open({str(big)!r}, 'rb')\n"
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "m[0], m[32 << 20]\n"  # two pages touched, as a loader touches a library's
        f"start_pages.record({str(tmp_path / 'pages.json')!r})\n"
    )
    _python(code)
    data = json.load(open(tmp_path / "pages.json"))
    ranges = dict((name, r) for name, r in data["files"])[str(big)]
    # each touched page, with at most the kernel's fault-around beside it (64 KiB by default)
    assert ranges[0][0] == 0 and ranges[-1][0] + ranges[-1][1] > 32 << 20
    assert sum(n for _, n in ranges) <= 4 << 20


def test_the_files_opened_for_reading_while_watched_join_the_record(tmp_path):
    names = {n: tmp_path / n for n in ("METADATA", "written.txt", "model.safetensors", "later.txt")}
    for p in names.values():
        p.write_bytes(b"x" * 5000)
    code = (
        "import os\n"
        "from cache import start_pages\n"
        "start_pages.watch_opens()\n"
        f"open({str(names['METADATA'])!r}).read()\n"  # what importlib.metadata does
        f"open({str(names['written.txt'])!r}, 'a').write('y')\n"
        f"os.close(os.open({str(names['model.safetensors'])!r}, os.O_RDONLY))\n"
        "start_pages.stop_watching()\n"
        f"open({str(names['later.txt'])!r}).read()\n"
        f"start_pages.record({str(tmp_path / 'pages.json')!r})\n"
    )
    _python(code)
    recorded = {name for name, _ in json.load(open(tmp_path / "pages.json"))["files"]}
    assert str(names["METADATA"]) in recorded
    assert not {str(names[n]) for n in ("written.txt", "model.safetensors", "later.txt")} & recorded


def test_reading_a_record_fills_the_page_cache_and_skips_what_is_gone(tmp_path):
    blob = tmp_path / "lib.bin"
    blob.write_bytes(os.urandom(3 << 20))
    with open(blob, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    page = os.sysconf("SC_PAGE_SIZE")
    record = {
        "format": start_pages.FORMAT,
        "bytes": 0,
        "files": [[str(tmp_path / "gone.so"), [[0, page]]], [str(blob), [[0, 2 << 20]]]],
    }
    path = tmp_path / "pages.json"
    path.write_text(json.dumps(record))
    # the missing file is skipped, the other read in full
    assert start_pages.read(str(path)) == 2 << 20
    assert resident_fraction(str(blob), 0, 2 << 20) == 1.0


def test_an_unreadable_or_foreign_record_reads_nothing(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "old.json").write_text(
        json.dumps({"format": 999, "files": [["/etc/hostname", [[0, 4096]]]]})
    )
    assert start_pages.read(str(tmp_path / "bad.json")) == 0
    assert start_pages.read(str(tmp_path / "old.json")) == 0
    assert start_pages.read(str(tmp_path / "missing.json")) == 0


def test_the_default_path_is_per_environment_under_the_cache_dir(tmp_path):
    p = start_pages.default_path(str(tmp_path))
    assert p.startswith(str(tmp_path / "start-pages")) and p.endswith(".json")
    assert start_pages.default_path(str(tmp_path)) == p
    serve, worker = (start_pages.default_path(str(tmp_path), e) for e in ("serve", "worker"))
    assert len({p, serve, worker}) == 3 and os.path.dirname(serve) == os.path.dirname(p)
