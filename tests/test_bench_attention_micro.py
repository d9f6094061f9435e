"""bench.attention_micro's prefill cases from the command line (the measurement itself needs a
GPU)."""

from __future__ import annotations

import pytest

from bench.attention_micro import prefill_cases


def test_prefill_cases_default_and_given():
    assert prefill_cases("", 4096) == [(1, 4096, 4096), (8, 512, 512), (1, 4096, 1024)]
    assert prefill_cases("2:1200:384,1:1500:768", 4096) == [(2, 1200, 384), (1, 1500, 768)]
    with pytest.raises(SystemExit, match="2:100:200"):
        prefill_cases("2:100:200", 4096)
