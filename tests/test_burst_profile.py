"""bench.burst_profile: the engine thread's py-spy samples inside a burst's window, bucketed by what
it was doing, each thread placed by its end at the server's exit (a file written here in py-spy's
speedscope layout: shared frames, one sampled profile per thread starting at that thread's first
sample, samples as frame indices, weights in seconds)."""

from __future__ import annotations

import json

import pytest

from bench.burst_profile import describe, summarise

FRAMES = [
    "AsyncLLM._loop",
    "Event.synchronize",
    "Condition.wait",
    "Linear.forward",
    "_trace_steps",
    "wait_idle",
    "EpollSelector.select",
]


def _profile(tmp_path, threads: dict[str, list[tuple[list[int], float]]]) -> str:
    body = {
        "shared": {"frames": [{"name": n, "file": "x.py", "line": 1} for n in FRAMES]},
        "profiles": [
            {
                "type": "sampled",
                "name": name,
                "samples": [stack for stack, _ in samples],
                "weights": [weight for _, weight in samples],
            }
            for name, samples in threads.items()
        ],
    }
    path = tmp_path / "run.speedscope.json"
    path.write_text(json.dumps(body))
    return str(path)


def test_engine_samples_are_placed_by_the_thread_s_end_at_the_server_s_exit(tmp_path):
    # window: 1.1 s to 2.2 s since the spawn; the server exits at 4.0 s
    run = {"first_token_s": 1.0, "burst_wall_s": 1.0, "stopped_s": 4.0}
    main = [([6], 4.0)]
    # the engine thread's samples sum to 3.0 s, so its first one begins at 1.0 s since the spawn;
    # from its own start they would begin at 0, 0.5, 0.8, 1.0, 1.4 and 2.0 s instead
    engine = [([0, 2], 0.5)]  # 1.0 s: before the window
    engine += [([0, 1], 0.3), ([0, 3], 0.2), ([0, 2], 0.4)]  # 1.5, 1.8 and 2.0 s: inside
    engine += [([0, 1], 0.6), ([0, 3], 1.0)]  # 2.4 and 3.0 s: after the window
    warmup = [([4, 5], 1.0), ([4], 1.0)]  # ends early: cannot be placed, not counted
    path = _profile(tmp_path, {"main": main, "coldbrew-engine": engine, "kernels": warmup})
    assert summarise(path, run) == pytest.approx(
        {"engine: GPU wait": 0.3, "engine: host": 0.2, "engine: no work": 0.4}
    )


def test_a_run_without_the_server_s_exit_time_cannot_be_aligned(tmp_path):
    run = {"first_token_s": 1.0, "burst_wall_s": 1.0, "ttft_p99_s": 0.5}
    path = _profile(tmp_path, {"coldbrew-engine": [([0, 1], 3.0)]})
    line = describe("b#3", run, path)
    assert line.startswith("b#3   burst 1.00 s, TTFT p99 0.50 s: ")
    assert "cannot be aligned" in line
    assert "engine:" not in line
