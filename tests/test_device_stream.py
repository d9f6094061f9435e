"""The device stream: a separate process fills a shareable GPU allocation from a pack; the engine
maps it.

References: the tensors written into the pack (bit-equal after the trip), the in-process loader, and
an engine that loads safetensors (same greedy tokens). CPU tests cover what a machine without a
driver does: a clear error from the process, and the in-process load instead.
"""

from __future__ import annotations

import os
import signal
import socket

import pytest
import torch

from cache import device_stream
from cache.loader import load_pack, register_pending
from cache.pack import read_pack
from conftest import free_gpu_memory
from engine import LLM, SamplingParams
from tests.test_loader import pack_of
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("gpu_memory_back")


def _ref() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        f"layer{g}.{k}": torch.randn(n, generator=gen).to(torch.bfloat16)
        for g in range(12)
        for k, n in (("a", 1_000_003), ("b", 333_333))
    }


# ---- CPU -----------------------------------------------------------------------------------------
def test_off_the_disk_one_reader_streams_large_chunks_and_from_memory_the_callers_many(
    tmp_path, monkeypatch
):
    from cache import stream_process
    from cache.loader import direct_reads_work
    from cache.prefetch import resident_fraction
    from cache.stream_process import DIRECT_CHUNK_BYTES, DIRECT_READERS, Streamer

    path = pack_of(_ref(), str(tmp_path / "p.cbpack"))
    a, b = socket.socketpair()
    with open(path, "rb") as f:
        f.read()  # in the page cache
    warm = Streamer(path, 0, a, threads=16, chunk_bytes=1 << 20)
    assert (warm.direct, warm.threads, warm.chunk_bytes) == (False, 16, 1 << 20)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    pack = read_pack(path)
    if resident_fraction(path, pack.data_offset, pack.data_nbytes) > 0.1:
        pytest.skip("this file system keeps the pack's pages (tmpfs)")
    assert direct_reads_work(path, pack.data_offset)
    cold = Streamer(path, 0, a, threads=16, chunk_bytes=1 << 20)
    assert cold.direct and cold.chunk_bytes == DIRECT_CHUNK_BYTES
    assert cold.threads == min(DIRECT_READERS, len(cold.chunks)) == 1
    assert cold.chunks == [(pack.data_offset, pack.data_nbytes)]  # smaller than one chunk
    # a file system that refuses O_DIRECT (some network and FUSE ones; this machine has none):
    # buffered reads, by the caller's many readers
    monkeypatch.setattr(stream_process, "direct_reads_work", lambda *a: False)
    refused = Streamer(path, 0, a, threads=16, chunk_bytes=1 << 20)
    assert (refused.direct, refused.threads, refused.chunk_bytes) == (False, 16, 1 << 20)
    assert not direct_reads_work(str(tmp_path / "missing.cbpack"), 0)
    a.close(), b.close()


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has an NVIDIA driver")
def test_without_a_driver_no_stream_starts(tmp_path):
    path = pack_of({"w": torch.ones(4)}, str(tmp_path / "p.cbpack"))
    assert device_stream.start(path) is None


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the process's error where there is no GPU"
)
def test_the_process_names_the_missing_driver_and_a_cpu_load_goes_on_in_process(tmp_path):
    ref = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    path = pack_of(ref, str(tmp_path / "p.cbpack"))
    stream = device_stream.DeviceStream(os.path.realpath(path), 0, 2, 1 << 20)
    with pytest.raises(device_stream.DeviceStreamError, match="libcuda"):
        stream.wait_for(lambda: stream.header is not None, timeout=60)
    assert stream.proc.wait(timeout=60) == 1
    register_pending(path, stream)  # a CPU load of the same file cancels it and reads for itself
    load = load_pack(path, "cpu")
    load.wait()
    assert all(torch.equal(load.tensors[k], v) for k, v in ref.items())


def test_the_stream_process_hears_mapped_and_stops_once_the_worker_is_gone(tmp_path):
    import socket
    import threading

    from cache.stream_process import Streamer

    path = pack_of({"w": torch.ones(4)}, str(tmp_path / "p.cbpack"))
    ours, theirs = socket.socketpair()
    streamer = Streamer(path, 0, theirs, threads=2, chunk_bytes=1 << 20)
    listener = threading.Thread(target=streamer.listen, daemon=True)
    listener.start()
    ours.sendall(b"mapped\n")
    # the worker holds its mapping; reads go on
    assert streamer.mapped.wait(10) and not streamer.stop.is_set()
    ours.close()  # the worker exited
    listener.join(10)
    assert not listener.is_alive() and streamer.stop.is_set()


# ---- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_streamed_pack_equals_its_tensors_and_each_group_waits_for_its_bytes(tmp_path):
    ref = _ref()
    path = pack_of(ref, str(tmp_path / "p.cbpack"), per_group=2)
    stream = device_stream.start(path, threads=4, chunk_bytes=1 << 20)
    assert stream is not None
    pack = read_pack(path)
    load = load_pack(pack, "cuda")
    assert isinstance(load, device_stream.DeviceStreamLoad)
    for g in pack.groups:
        load.wait_group(g)
        assert load.group_ready(g)
        for k in "ab":
            assert torch.equal(load.tensors[f"layer{g}.{k}"].cpu(), ref[f"layer{g}.{k}"]), (g, k)
    stats = load.wait()
    assert stats.mode.startswith("process-") and stats.nbytes == pack.data_nbytes and stats.gbps > 0
    assert stream.proc.wait(timeout=60) == 0  # it lets go once the engine holds its own mapping
    before = torch.cuda.mem_get_info()[0]
    del load
    free_gpu_memory()
    # unmapped with the last view
    assert torch.cuda.mem_get_info()[0] > before + pack.data_nbytes // 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_stream_process_killed_before_the_engine_claims_it_means_an_in_process_load(tmp_path):
    ref = _ref()
    path = pack_of(ref, str(tmp_path / "p.cbpack"))
    stream = device_stream.start(path, threads=2, chunk_bytes=1 << 20)
    stream.proc.send_signal(signal.SIGKILL)
    stream.proc.wait()
    load = load_pack(path, "cuda")
    assert not isinstance(load, device_stream.DeviceStreamLoad)
    load.wait()
    assert all(torch.equal(load.tensors[k].cpu(), v) for k, v in ref.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_on_a_streamed_pack_gives_the_safetensors_engines_tokens(tmp_path):
    model_dir = str(tmp_path / "model")
    make_tiny_model("qwen2", model_dir)
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    opts = dict(model=model_dir, device="cuda", dtype="bfloat16", num_kv_blocks=32)
    ref = [
        o.outputs[0].token_ids
        for o in LLM(load_format="safetensors", **opts).generate(prompts, params)
    ]
    LLM(**opts)  # writes the pack
    assert device_stream.start(model_dir) is not None
    llm = LLM(**opts)
    model = llm.engine.runner.model
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    model.wait_weights()
    assert model.load_stats["mode"].startswith("process-")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_worker_boot_streams_the_pack_it_wrote_on_its_first_start(tmp_path):
    import asyncio

    # the worker's own dependencies (make gpu-check needs only torch's)
    pytest.importorskip("pydantic")
    from handler.config import load_settings
    from handler.engine_boot import EngineBoot

    model_dir = str(tmp_path / "model")
    make_tiny_model("llama", model_dir)
    settings = load_settings(
        {
            "MODEL_NAME": model_dir,
            "MAX_MODEL_LEN": "128",
            "DEVICE": "cuda",
            "GPU_MEMORY_UTILIZATION": "0.3",
            "CACHE_DIR": str(tmp_path / "cache"),
        }
    )
    outputs, streams = [], []
    # the first start writes the pack, the second streams it from a separate process
    for _ in range(2):
        boot = EngineBoot(settings)
        engine = asyncio.run(boot.ready())
        outputs.append(engine.engine.runner.model.embed_tokens.weight.float().sum().item())
        streams.append((boot.weight_stream, engine.engine.runner.model.load_stats.get("source")))
        engine.shutdown()
        del engine, boot
        free_gpu_memory()
    assert streams == [("prefetch", "safetensors"), ("device_stream", "pack")]
    assert outputs[0] == outputs[1]
