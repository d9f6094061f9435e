"""The streaming loader (cache.loader) and the engine's pack path (engine.models.weights), against
safetensors.

CPU: loaded tensors equal what safetensors reads, per-group readiness, prefetch before torch, packs
written on the first load and used on the next, torn packs rebuilt, greedy parity through
engine.LLM. GPU: the same into CUDA.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cache.loader import load_pack, prefetch, resident_fraction
from cache.pack import PackError, PackWriter, read_pack
from engine import LLM, SamplingParams
from engine.attention import kv_cache_shape
from engine.config import ModelConfig
from engine.models.weights import load_model, load_model_from_pack, pack_path, safetensors_files
from tests.child_process import kill_when_midway
from tests.tiny_models import PagedSeq, make_step, make_tiny_model

REPO = Path(__file__).resolve().parent.parent


def safetensors_reference(model_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def pack_of(tensors: dict[str, torch.Tensor], path: str, per_group: int = 2) -> str:
    with PackWriter(path, metadata={"test": True}) as w:
        for i, (name, t) in enumerate(tensors.items()):
            w.add(
                name,
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                t.contiguous().reshape(-1).view(torch.uint8).numpy(),
                group=i // per_group,
            )
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", str(d), max_shard_size="40KB")  # several shards
    return str(d)


def mixed_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        f"t{i}": (torch.randn(n, generator=gen) * 3).to(dt)
        for i, (n, dt) in enumerate(
            [
                (100_003, torch.float32),
                (7, torch.bfloat16),
                (50_000, torch.float16),
                (0, torch.float32),
                (3, torch.int64),
                (123_457, torch.bfloat16),
            ]
        )
    }


@pytest.mark.parametrize(
    "direct,threads,chunk",
    [(False, 1, 16 << 20), (False, 4, 8192), (True, 3, 12288), ("auto", 8, 4096)],
)
def test_cpu_load_equals_what_safetensors_reads(tiny_dir, tmp_path, direct, threads, chunk):
    ref = safetensors_reference(tiny_dir)
    assert len(safetensors_files(tiny_dir)) > 1
    pack = read_pack(pack_of(ref, str(tmp_path / "p.cbpack")))
    load = load_pack(pack, "cpu", threads=threads, chunk_bytes=chunk, direct=direct)
    stats = load.wait()
    assert stats.nbytes == pack.data_nbytes and stats.mode in ("direct", "buffered")
    assert set(load.tensors) == set(ref)
    for name, t in ref.items():
        view = load.tensors[name]
        assert view.dtype == t.dtype and view.shape == t.shape and torch.equal(view, t), name
        # one allocation
        assert view.untyped_storage().data_ptr() == load.buffer.untyped_storage().data_ptr()
    assert all(load.group_ready(g) for g in pack.groups)


def test_groups_become_ready_and_mixed_dtypes_survive(tmp_path):
    ref = mixed_tensors()
    pack = read_pack(pack_of(ref, str(tmp_path / "p.cbpack"), per_group=1))
    load = load_pack(pack, "cpu", threads=2, chunk_bytes=8192)
    for g, (name, t) in enumerate(ref.items()):
        load.wait_group(g)
        assert load.group_ready(g) and torch.equal(load.tensors[name], t), name
    load.wait()


def test_a_file_shrunk_under_the_loader_is_an_error_not_garbage(tmp_path):
    path = pack_of(mixed_tensors(), str(tmp_path / "p.cbpack"))
    pack = read_pack(path)
    os.truncate(path, pack.data_offset + 8192)
    with pytest.raises(PackError, match="end of file"):
        load_pack(pack, "cpu", threads=2, chunk_bytes=4096, direct=False).wait()


def test_bad_loader_options_name_the_field(tmp_path):
    pack = read_pack(pack_of(mixed_tensors(), str(tmp_path / "p.cbpack")))
    with pytest.raises(ValueError, match="chunk_bytes"):
        load_pack(pack, "cpu", chunk_bytes=1000)
    with pytest.raises(ValueError, match="threads"):
        load_pack(pack, "cpu", threads=0)


def test_prefetch_imports_only_the_stdlib_and_fills_the_page_cache(tmp_path):
    path = pack_of({"big": torch.randn(4 << 20)}, str(tmp_path / "p.cbpack"))  # 16 MiB
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    before = resident_fraction(path)
    if before is None or before > 0.5:
        pytest.skip(f"this filesystem keeps the file cached after DONTNEED (resident {before})")
    code = (
        "import sys\nfrom cache.loader import prefetch, resident_fraction\n"
        f"p = prefetch({path!r}, threads=3, chunk_bytes=1 << 20)\nassert p.wait(60)\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] in ('torch', 'numpy', 'safetensors')),\n"
        f"      p.bytes_read, resident_fraction({path!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    modules, nbytes, after = (
        out.stdout.rsplit("]", 1)[0] + "]",
        *out.stdout.rsplit("]", 1)[1].split(),
    )
    assert modules == "[]"
    assert int(nbytes) >= (16 << 20) * (1 - before) - (1 << 20) and float(after) > 0.9


def test_prefetch_of_a_model_dir_takes_its_newest_pack(tiny_dir, tmp_path):
    p = prefetch(tiny_dir)  # no pack yet: the safetensors shards
    assert sorted(p.paths) == sorted(safetensors_files(tiny_dir)) and p.wait(60)


# ---- the engine's side ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3-tied"])
def test_first_load_writes_the_pack_and_the_next_loads_identical_weights_from_it(tmp_path, family):
    model_dir = str(tmp_path / "model")
    make_tiny_model(family, model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    first = load_model(model_dir, cfg, "float32", "cpu")
    assert first.load_stats["source"] == "safetensors"
    written = first.load_stats["pack_written"]
    assert written == pack_path(model_dir, torch.float32) and written.startswith(
        os.path.join(model_dir, "packs")
    )
    second = load_model(model_dir, cfg, "float32", "cpu")
    assert second.load_stats["source"] == "pack" and second.load_stats["nbytes"] > 0
    a, b = dict(first.named_parameters()), dict(second.named_parameters())
    assert set(a) == set(b)
    storage = {p.untyped_storage().data_ptr() for p in b.values()}
    assert len(storage) == 1  # every parameter is a view into one buffer
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    for (n1, b1), (n2, b2) in zip(first.named_buffers(), second.named_buffers()):
        assert n1 == n2 and torch.equal(b1, b2), n1
    bf16 = load_model(model_dir, cfg, "bfloat16", "cpu")  # another dtype is another pack
    assert bf16.load_stats["source"] == "safetensors" and bf16.load_stats["pack_written"] != written


def test_a_forward_started_while_the_weights_stream_waits_per_layer_and_matches(tiny_dir, tmp_path):
    cfg = ModelConfig.from_dir(tiny_dir)
    # writes the pack
    ref_model = load_model(tiny_dir, cfg, "float32", "cpu", pack_dir=str(tmp_path))
    path = ref_model.load_stats["pack_written"]
    streaming = load_model_from_pack(
        path,
        None,
        cfg,
        torch.float32,
        torch.device("cpu"),
        overlap=True,
        threads=2,
        chunk_bytes=4096,
    )
    assert streaming.load_stats.get("streaming") is True
    seqs = [PagedSeq(tokens=[3, 14, 15, 92, 65, 35, 89, 79], block_table=[2, 0])]
    kv = torch.zeros(kv_cache_shape(cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim))
    outs = []
    for model in (streaming, ref_model):
        for s in seqs:
            s.num_cached = 0
        ids, positions, meta = make_step(seqs, [8], 4)
        with torch.inference_mode():
            outs.append(model.compute_logits(model(ids, positions, kv.clone(), meta)))
    assert torch.equal(outs[0], outs[1])
    assert streaming.load_stats["source"] == "pack" and streaming.load_stats["nbytes"] > 0
    # the final norm's hook waited for every byte, then left
    assert "seconds" in streaming.load_stats
    assert not any(m._forward_pre_hooks for m in streaming.modules())
    streaming.wait_weights()  # idempotent


def test_a_truncated_pack_is_rebuilt_with_one_log_line(tiny_dir, tmp_path, caplog):
    cfg = ModelConfig.from_dir(tiny_dir)
    pack_dir = str(tmp_path / "packs")
    load_model(tiny_dir, cfg, "float32", "cpu", pack_dir=pack_dir)
    path = pack_path(tiny_dir, torch.float32, pack_dir)
    os.truncate(path, os.path.getsize(path) - 4096)
    with caplog.at_level(logging.WARNING, logger="engine.models.weights"):
        model = load_model(tiny_dir, cfg, "float32", "cpu", pack_dir=pack_dir)
    assert model.load_stats["source"] == "safetensors" and model.load_stats["pack_written"] == path
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "truncated" in lines[0] and "rebuilding" in lines[0]
    assert (
        load_model(tiny_dir, cfg, "float32", "cpu", pack_dir=pack_dir).load_stats["source"]
        == "pack"
    )


def test_an_unwritable_pack_dir_logs_and_still_loads(tiny_dir, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="engine.models.weights"):
        model = load_model(
            tiny_dir, ModelConfig.from_dir(tiny_dir), "float32", "cpu", pack_dir=str(blocker / "x")
        )
    assert model.load_stats == {"source": "safetensors", "pack_written": None}
    assert len(caplog.records) == 1 and "could not write the pack" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="load_format"):
        load_model(tiny_dir, ModelConfig.from_dir(tiny_dir), "float32", "cpu", load_format="gguf")


def test_a_load_killed_while_writing_the_pack_is_rebuilt_by_the_next_start(tiny_dir, tmp_path):
    pack_dir = str(tmp_path / "packs")
    child = textwrap.dedent(f"""
        import time
        import cache.pack
        from engine.config import ModelConfig
        from engine.models.weights import load_model
        add, count = cache.pack.PackWriter.add, [0]
        # pause after two tensors so the parent kills a half-written pack
        def slow_add(self, *args, **kwargs):
            add(self, *args, **kwargs)
            count[0] += 1
            if count[0] == 2:
                self._file.flush()
                print("midway", flush=True)
                time.sleep(60)
        cache.pack.PackWriter.add = slow_add
        config = ModelConfig.from_dir({tiny_dir!r})
        load_model({tiny_dir!r}, config, "float32", "cpu", pack_dir={pack_dir!r})
    """)
    kill_when_midway(child)
    path = pack_path(tiny_dir, torch.float32, pack_dir)
    # only the dead writer's temp file
    assert not os.path.exists(path) and len(os.listdir(pack_dir)) == 1
    cfg = ModelConfig.from_dir(tiny_dir)
    rebuilt = load_model(tiny_dir, cfg, "float32", "cpu", pack_dir=pack_dir)
    assert rebuilt.load_stats["source"] == "safetensors" and os.listdir(pack_dir) == [
        os.path.basename(path)
    ]
    again = load_model(tiny_dir, cfg, "float32", "cpu", pack_dir=pack_dir)
    assert again.load_stats["source"] == "pack"
    ref = safetensors_reference(tiny_dir)
    assert torch.equal(
        dict(again.named_parameters())["layers.1.mlp.down_proj.weight"],
        ref["model.layers.1.mlp.down_proj.weight"],
    )


@pytest.mark.slow
def test_greedy_outputs_are_identical_from_the_pack_and_from_safetensors(smollm2_dir, tmp_path):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    opts = dict(
        device="cpu",
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=32,
        block_size=16,
        pack_dir=str(tmp_path),
    )
    runs = []
    # the first start loads safetensors and writes the pack; the second loads the pack
    for _ in range(2):
        llm = LLM(model=smollm2_dir, **opts)
        runs.append(
            (
                [o.outputs[0].token_ids for o in llm.generate(prompts, params)],
                llm.engine.runner.model.load_stats["source"],
            )
        )
        del llm
    assert [source for _, source in runs] == ["safetensors", "pack"]
    assert runs[0][0] == runs[1][0] and all(len(ids) == 8 for ids in runs[1][0])


# ---- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("direct", [False, True])
def test_cuda_load_equals_the_source_and_every_group_event_fires(tmp_path, direct):
    gen = torch.Generator().manual_seed(2)
    ref = {
        f"layer{g}.{k}": torch.randn(n, generator=gen).to(torch.bfloat16)
        for g in range(12)
        for k, n in (("a", 1_000_003), ("b", 333_333))
    }
    pack = read_pack(pack_of(ref, str(tmp_path / "p.cbpack"), per_group=2))
    load = load_pack(pack, "cuda", threads=4, chunk_bytes=1 << 20, direct=direct)
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        sums = []
        for g in pack.groups:
            # the consumer stream waits on the group's copy event, the host does not
            load.wait_group(g)
            sums.append(sum(load.tensors[f"layer{g}.{k}"].float().sum() for k in "ab"))
    consumer.synchronize()
    stats = load.wait()
    assert all(load.group_ready(g) for g in pack.groups)
    for g, s in enumerate(sums):
        expected = sum(ref[f"layer{g}.{k}"].cuda().float().sum() for k in "ab")
        assert torch.equal(s, expected), g
    for name, t in ref.items():
        assert load.tensors[name].device.type == "cuda" and torch.equal(
            load.tensors[name].cpu(), t
        ), name
    assert stats.nbytes == pack.data_nbytes and stats.gbps > 0


@pytest.mark.gpu
def test_cuda_model_from_the_pack_equals_the_safetensors_model(tmp_path):
    model_dir = str(tmp_path / "model")
    make_tiny_model("qwen2", model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    first = load_model(model_dir, cfg, "bfloat16", "cuda")
    second = load_model(model_dir, cfg, "bfloat16", "cuda")
    assert (first.load_stats["source"], second.load_stats["source"]) == ("safetensors", "pack")
    # on CUDA load_model returns while the bytes stream
    assert second.load_stats.get("streaming") is True
    second.wait_weights()
    assert "gbps" in second.load_stats
    a, b = dict(first.named_parameters()), dict(second.named_parameters())
    for name in a:
        assert b[name].is_cuda and torch.equal(a[name], b[name]), name
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [
        [
            o.outputs[0].token_ids
            for o in LLM(
                model=model_dir, device="cuda", dtype="bfloat16", num_kv_blocks=32, load_format=fmt
            ).generate(prompts, params)
        ]
        for fmt in ("safetensors", "auto")
    ]
    assert outs[0] == outs[1]
