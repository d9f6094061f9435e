"""The start path's head start: prefetch coverage, loaders reading behind a prefetch, preloads taken
over by the engine (or dropped when it loads another file), and what the start path imports before
the weights stream.

CPU only (the CUDA side is in tests/test_cold_start_gpu.py); references are safetensors' own reads
of the model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cache.loader import discard_preloads, load_pack, prefetch, preload, read_pack
from cache.pack import PackWriter
from engine import LLM, EngineArgs, SamplingParams
from engine.config import ModelConfig
from engine.models.weights import load_model, pack_path, preload_weights, safetensors_files
from tests.tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parent.parent


def write_pack(path: str, tensors: dict[str, torch.Tensor]) -> str:
    with PackWriter(path, metadata={"test": True}) as w:
        for i, (name, t) in enumerate(tensors.items()):
            w.add(
                name,
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                t.contiguous().reshape(-1).view(torch.uint8).numpy(),
                group=i,
            )
    return path


def random_tensors(n: int = 6, numel: int = 300_007) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(numel + i, generator=gen) for i in range(n)}


@pytest.fixture
def model_dir(tmp_path) -> str:
    d = str(tmp_path / "model")
    make_tiny_model("llama", d, max_shard_size="40KB")
    return d


def test_wait_covered_returns_once_the_prefetch_has_read_that_far(tmp_path):
    path = write_pack(str(tmp_path / "p.cbpack"), random_tensors())
    size = os.path.getsize(path)
    p = prefetch(path, threads=2, chunk_bytes=1 << 20)
    assert p.wait_covered(path, size, timeout=60)
    assert p.wait(60) and p.done()
    # whatever was not already cached has been read, and a finished prefetch answers at once for any
    # path
    assert p.bytes_read <= size and p.wait_covered(str(tmp_path / "other"), 1 << 40, timeout=0)


def test_a_load_reading_behind_a_prefetch_equals_the_source(tmp_path):
    ref = random_tensors(8)
    path = write_pack(str(tmp_path / "p.cbpack"), ref)
    # small reads: the loader catches up and must wait
    p = prefetch(path, threads=1, chunk_bytes=64 << 10)
    load = load_pack(path, "cpu", threads=4, chunk_bytes=8192)
    stats = load.wait()
    assert p.wait(60) and stats.mode == "buffered"
    for name, t in ref.items():
        assert torch.equal(load.tensors[name], t), name


def test_a_preload_is_taken_over_by_the_load_of_the_same_file(tmp_path):
    ref = random_tensors()
    path = write_pack(str(tmp_path / "p.cbpack"), ref)
    started = preload(path, "cpu", threads=2, chunk_bytes=1 << 20)
    assert started is not None
    taken = load_pack(path, "cpu")
    assert taken is started  # no second stream, no second buffer
    taken.wait()
    assert all(torch.equal(taken.tensors[n], t) for n, t in ref.items())
    assert load_pack(path, "cpu") is not started  # taken once only: a later load starts its own


def test_discard_drops_preloads_of_other_files_only(tmp_path):
    a = write_pack(str(tmp_path / "a.cbpack"), random_tensors(2))
    b = write_pack(str(tmp_path / "b.cbpack"), random_tensors(3))
    la, lb = preload(a, "cpu"), preload(b, "cpu")
    assert discard_preloads(keep=b) == 1
    assert la.buffer is None and la.tensors == {}  # cancelled and freed
    assert load_pack(b, "cpu") is lb
    assert discard_preloads() == 0


def test_preload_of_a_directory_without_a_pack_starts_nothing(model_dir):
    assert preload(model_dir, "cpu") is None


def test_preload_weights_does_nothing_on_cpu_and_the_engine_drops_a_stray_preload(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    load_model(model_dir, cfg, "float32", "cpu")  # writes the float32 pack
    assert preload_weights(EngineArgs(model=model_dir, device="cpu")) is False
    f32 = pack_path(model_dir, torch.float32)
    # a float32 preload, then an engine that wants bfloat16: the preload is dropped
    stray = preload(f32, "cpu")
    model = load_model(model_dir, cfg, "bfloat16", "cpu")
    assert stray.buffer is None and model.load_stats["source"] == "safetensors"
    again = preload(f32, "cpu")  # the matching one is used
    model = load_model(model_dir, cfg, "float32", "cpu")
    assert model.load_stats["source"] == "pack" and again.buffer is not None
    params = dict(model.named_parameters())
    assert (
        params["embed_tokens.weight"].untyped_storage().data_ptr()
        == again.buffer.untyped_storage().data_ptr()
    )
    checked = 0
    for path in safetensors_files(model_dir):  # every unfused tensor equals what safetensors reads
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                ours = name.removeprefix("model.")
                if ours in params:
                    assert torch.equal(params[ours], f.get_tensor(name).float()), name
                    checked += 1
    assert checked >= 3


def test_the_start_path_streams_before_importing_triton_or_transformers(model_dir):
    """Up to the preload the start path imports torch, the config and the loader only; the whole
    engine start and a generation never import transformers."""
    code = (
        "import sys\n"
        "from cache.loader import prefetch\n"
        f"prefetch({model_dir!r})\n"
        "from engine.config import EngineArgs\n"
        "from engine.models.weights import preload_weights\n"
        f"preload_weights(EngineArgs(model={model_dir!r}, device='cpu'))\n"
        "early = sorted(m for m in ('triton', 'transformers', 'tokenizers', 'jinja2',\n"
        "                           'engine.models.decoder') if m in sys.modules)\n"
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM(model={model_dir!r}, device='cpu', num_kv_blocks=16, block_size=4)\n"
        "params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)\n"
        "out = llm.generate([[3, 5, 7]], params)\n"
        "print(early, len(out[0].outputs[0].token_ids), 'transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "2", "False"]


def test_engine_args_name_the_start_up_switches():
    for bad, field in [
        (dict(kv_sizing="guess"), "kv_sizing"),
        (dict(cuda_graph_capture="never"), "cuda_graph_capture"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineArgs(model="x", **bad).validate()
    args = EngineArgs(model="x")
    assert (args.kv_sizing, args.cuda_graph_capture) == ("analytic", "lazy")


def test_cpu_engine_greedy_output_is_the_same_with_a_preloaded_pack(model_dir):
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = [
        o.outputs[0].token_ids
        for o in LLM(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=32).generate(
            prompts, params
        )
    ]
    started = preload(pack_path(model_dir, torch.float32), "cpu")
    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=32)
    assert llm.engine.runner.model.load_stats["source"] == "pack" and started.buffer is not None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == first
    assert read_pack(pack_path(model_dir, torch.float32)).data_nbytes == started.buffer.numel()
