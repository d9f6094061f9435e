"""bench.burst_profile: a py-spy speedscope file's samples inside a burst's window, bucketed by what
the engine thread and the kernel warm-up were doing (a file written here in py-spy's speedscope
layout: shared frames, one sampled profile per thread, samples as frame indices, weights in
seconds)."""

from __future__ import annotations

import json

import pytest

from bench.burst_profile import summarise

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


def test_samples_inside_the_window_are_bucketed_by_what_each_thread_did(tmp_path):
    run = {"first_token_s": 1.0, "burst_wall_s": 1.0}  # window: 1.1 s to 2.2 s
    engine = [([0, 2], 1.1)]  # before the window: not counted
    engine += [([0, 1], 0.3), ([0, 3], 0.2), ([0, 2], 0.4)]
    engine += [([0, 1], 5.0)]  # starts at 2.0 s: inside; counted whole
    engine += [([0, 1], 1.0)]  # starts at 7.0 s: after the window
    warmup = [([4, 5], 1.5), ([4], 0.5), ([4, 5], 1.0)]
    main = [([6], 3.0)]
    path = _profile(tmp_path, {"coldbrew-engine": engine, "kernels": warmup, "main": main})
    seconds = summarise(path, run)
    # a sample counts where it starts: engine samples at 1.1, 1.4, 1.6 and 2.0 s; the warm-up's at
    # 1.5 (tracing) and 2.0 s (waiting for requests); the main thread's fits no bucket
    assert seconds == pytest.approx(
        {
            "engine: GPU wait": 0.3 + 5.0,
            "engine: host": 0.2,
            "engine: no work": 0.4,
            "warm-up: tracing": 0.5,
            "warm-up: waiting": 1.0,
        }
    )
