"""cuBLAS's first-use setup begun on a thread after `import torch` (engine.device_warmup): nothing
off CUDA or without a readable config; the GEMMs it runs have the shapes of the model's own linears
(the model built on the meta device is the reference); on a GPU the thread ends and the engine's
GEMMs on other threads are unchanged by it."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from engine.config import EngineArgs, ModelConfig
from engine.device_warmup import begin_cublas, warmup_shapes
from engine.distributed.sharding import Shard
from engine.models.decoder import build_model

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "bench", "configs")


def test_no_warm_up_on_cpu(smollm2_dir) -> None:
    assert begin_cublas(EngineArgs(model=smollm2_dir, device="cpu")) is None


def test_no_warm_up_without_a_config(tmp_path) -> None:
    assert begin_cublas(EngineArgs(model=str(tmp_path), device="cuda")) is None


def _linear_shapes(config: ModelConfig, tp_size: int) -> set[tuple[int, int]]:
    """The 2-D weights of the model's decoder layers, built on the meta device (no memory)."""
    model = build_model(config, torch.bfloat16, "cpu", param_device="meta", shard=Shard(0, tp_size))
    return {
        tuple(p.shape)
        for name, p in model.named_parameters()
        if name.startswith("layers.") and p.dim() == 2
    }


@pytest.mark.parametrize(
    "name, tp_size",
    [
        ("llama-3.1-8b", 1),
        ("llama-3.1-8b", 8),
        ("phi-4", 1),
        ("gemma-3-27b-it", 1),
        ("qwen3-30b-a3b", 1),
        ("qwen1.5-moe-a2.7b", 1),
    ],
)
def test_the_warm_up_runs_the_shapes_of_the_models_linears(name, tp_size) -> None:
    with open(os.path.join(CONFIGS, f"{name}.json")) as f:
        config = ModelConfig.from_dict(json.load(f))
    shapes = warmup_shapes(config, tp_size)
    assert len(shapes) == len(set(shapes))
    # a mixture of experts' stacked expert weights are 3-D (Triton's kernels): not among these
    assert set(shapes) == _linear_shapes(config, tp_size)


def test_a_quantized_model_warms_only_the_handle() -> None:
    with open(os.path.join(CONFIGS, "llama-3.1-8b.json")) as f:
        config = ModelConfig.from_dict(json.load(f))
    assert warmup_shapes(config, 1, "fp8") == [(config.hidden_size, config.hidden_size)]


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
