"""bench.decode_profile's kernel tables from a profiler trace (the profiling itself needs a GPU):
the kernel events as torch.profiler's chrome trace writes them ("cat": "kernel", "dur" in us,
"args": {"grid": [x, y, z]})."""

from __future__ import annotations

import pytest

from bench.decode_profile import tables_from_trace


def test_tables_by_kernel_and_by_launch_grid():
    def kernel(name, dur, grid):
        return {"ph": "X", "cat": "kernel", "name": name, "dur": dur, "args": {"grid": grid}}

    events = []
    for _ in range(2):  # two replays of a step: two GEMV shapes, one attention launch, a copy
        events += [
            kernel("_row_gemv_kernel", 10.0, [384, 1, 1]),
            kernel("_row_gemv_kernel", 30.0, [1792, 1, 1]),
            kernel("paged_attention_kernel", 5.0, [1, 24, 1]),
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "dur": 99.0, "args": {}},
        ]
    kernels, launches = tables_from_trace(events, calls=2)
    assert kernels == {
        "_row_gemv_kernel": {"us": pytest.approx(40.0), "launches": 2.0},
        "paged_attention_kernel": {"us": pytest.approx(5.0), "launches": 1.0},
    }
    assert list(launches) == [
        "_row_gemv_kernel grid 1792x1x1",
        "_row_gemv_kernel grid 384x1x1",
        "paged_attention_kernel grid 1x24x1",
    ]
    assert launches["_row_gemv_kernel grid 384x1x1"] == {"us": 10.0, "launches": 1.0}
