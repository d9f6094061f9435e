"""The start benchmarks' own logic on the CPU: bench.start_profile's reading of a py-spy speedscope
file into per-thread segments, and bench.read_contention's stream and probes on a small file."""

from __future__ import annotations

import json

from bench import read_contention, start_profile


def test_a_speedscope_profile_becomes_segments_per_thread(tmp_path):
    repo = start_profile.REPO
    frames = [
        {"name": "main", "file": str(repo / "handler" / "__main__.py")},
        {"name": "load_settings", "file": str(repo / "handler" / "config.py")},
        {"name": "<module>", "file": "/usr/lib/python3/site-packages/pydantic/__init__.py"},
        {"name": "run", "file": str(repo / "warmup" / "start.py")},
        {"name": "<module>", "file": "/usr/lib/python3/site-packages/torch/__init__.py"},
    ]
    main_samples = [[0, 1, 2]] * 30 + [[0, 1]] * 1 + [[0, 3, 4]] * 50
    data = {
        "shared": {"frames": frames},
        "profiles": [
            {"name": 'Thread 1 "MainThread"', "samples": main_samples, "weights": [0.01] * 81},
            {"name": 'Thread 2 "idle"', "samples": [[3]], "weights": [0.01]},
        ],
    }
    path = tmp_path / "p.speedscope.json"
    path.write_text(json.dumps(data))
    threads = start_profile.summarise(str(path))
    main = threads['Thread 1 "MainThread"']
    assert abs(main["seconds"] - 0.81) < 1e-9
    labels = [(label, round(seconds, 2)) for label, _, seconds in main["segments"]]
    # the one-sample segment is folded into the one before; imports show the module they run
    assert labels == [
        ("handler/config.py:load_settings > <module> (pydantic/__init__.py)", 0.31),
        ("warmup/start.py:run > <module> (torch/__init__.py)", 0.50),
    ]


def test_the_read_contention_probe_runs_beside_a_stream(tmp_path):
    big = read_contention._big_file(str(tmp_path / "big.bin"), 64 / 1024)
    probes = read_contention._probes(str(tmp_path / "probes"), 3)
    alone = read_contention.measure(big, probes, 0, 0, 0.0)
    beside = read_contention.measure(big, probes, 2, 4, 0.1)
    assert alone["config"] == "none" and "stream_GBps" not in alone
    assert beside["config"] == "2x4" and beside["stream_GBps"] > 0
    assert beside["probe_ms"]["median"] > 0 and len(probes) == 3
