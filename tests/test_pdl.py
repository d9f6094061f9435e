"""engine.pdl: which launches take programmatic dependent launch. On for Triton targets of sm_90
and later (griddepcontrol exists from Hopper on), off below, off without a driver (Triton's
interpreter) and when turned off; the answer follows the active driver as warmup.aot swaps it (a
GPU-less build for sm_80, then sm_90)."""

from __future__ import annotations

import pytest

from conftest import triton_nvidia_backend
from engine import pdl

OFF = {"PDL": False, "launch_pdl": False}
ON = {"PDL": True, "launch_pdl": True}


def test_only_hopper_and_later_cuda_targets_take_it():
    assert pdl.target_supports("cuda", 90) and pdl.target_supports("cuda", 100)
    assert not pdl.target_supports("cuda", 80) and not pdl.target_supports("cuda", 89)
    assert not pdl.target_supports("hip", "gfx942")


@pytest.mark.skipif(not triton_nvidia_backend(), reason="triton without its CUDA backend")
def test_the_launch_follows_the_active_target_and_the_switch(monkeypatch):
    from warmup.aot import target_driver

    for arch, expected in (("sm_80", OFF), ("sm_90", ON), ("sm_86", OFF), ("sm_90", ON)):
        with target_driver(arch):
            assert pdl.launch_options() == expected, arch
            assert pdl.launch_options(wanted=False) == OFF
            monkeypatch.setattr(pdl, "ENABLED", False)
            assert pdl.launch_options() == OFF
            monkeypatch.setattr(pdl, "ENABLED", True)


def test_no_driver_means_no_early_launch(monkeypatch):
    """The interpreter's launches (CPU tests) have no CUDA driver behind them."""
    triton = pytest.importorskip("triton")

    class NoDriver:
        @property
        def active(self):
            raise RuntimeError("0 active drivers ([]). There should only be one.")

    monkeypatch.setattr(triton.runtime, "driver", NoDriver())
    assert pdl.launch_options() == OFF
