"""The runner's pick of the rows that need logits (engine.runner._take_rows) equals indexing by
them: a view when they follow one another, a gather otherwise; on a GPU the view does not wait for
the stream's queued work (the gather's index, copied from pageable memory, does)."""

from __future__ import annotations

import pytest
import torch

from engine.runner import _take_rows


@pytest.mark.parametrize("rows", [[5], [0, 1, 2], [3, 4], [0, 2], [1, 4, 5], [6, 2]])
def test_the_rows_taken_equal_indexing(rows):
    x = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    got = _take_rows(x, rows)
    torch.testing.assert_close(got, x[torch.tensor(rows)])
    following = all(r == rows[0] + i for i, r in enumerate(rows))
    assert (got.data_ptr() == x[rows[0]].data_ptr()) == following  # a view only then


@pytest.mark.gpu
def test_a_view_of_following_rows_does_not_wait_for_the_stream():
    x = torch.randn(64, 128, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # queued work the pick must not wait for (about a second)
    queued = torch.cuda.Event()
    queued.record()
    _take_rows(x, [63])
    assert not queued.query(), "the pick waited for the stream"
    torch.cuda.synchronize()
