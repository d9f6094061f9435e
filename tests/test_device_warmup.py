"""cuBLAS's first-use setup begun on a thread after `import torch` (engine.device_warmup): nothing
off CUDA or without a readable config; on a GPU the thread ends and the engine's GEMMs on other
threads are unchanged by it."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import EngineArgs
from engine.device_warmup import begin_cublas


def test_no_warm_up_on_cpu(smollm2_dir) -> None:
    assert begin_cublas(EngineArgs(model=smollm2_dir, device="cpu")) is None


def test_no_warm_up_without_a_config(tmp_path) -> None:
    assert begin_cublas(EngineArgs(model=str(tmp_path), device="cuda")) is None


@pytest.mark.gpu
def test_the_warm_up_ends_and_gemms_on_other_threads_stay_exact(smollm2_dir) -> None:
    thread = begin_cublas(EngineArgs(model=smollm2_dir, device="cuda"))
    assert thread is not None and thread.name == "coldbrew-cublas"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(1536, 576, generator=gen).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), w.float())
    got: dict[str, torch.Tensor] = {}

    def engine_thread() -> None:  # the engine's GEMMs run on a thread of their own, meanwhile
        got["y"] = torch.nn.functional.linear(x.cuda(), w.cuda()).float().cpu()

    other = threading.Thread(target=engine_thread)
    other.start()
    other.join(60)
    thread.join(60)
    assert not thread.is_alive()
    torch.testing.assert_close(got["y"], want, rtol=2e-2, atol=2e-1)
