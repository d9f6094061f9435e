"""The packed weight format (cache.pack): round trip of every dtype and shape, 4 KiB alignment, the
index, and the faults: a truncated or torn pack is refused, a writer SIGKILLed mid-pack leaves
nothing a reader accepts.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from cache.pack import ALIGNMENT, PackError, PackWriter, find_packs, read_pack
from child_process import kill_when_midway


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.float32": torch.randn(3, 5, generator=gen),
        "b.bfloat16": torch.randn(7, 9, 2, generator=gen).to(torch.bfloat16),
        "c.float16": torch.randn(4097, generator=gen).to(torch.float16),  # spans a 4 KiB boundary
        "d.int8": torch.randint(-128, 127, (33,), generator=gen, dtype=torch.int8),
        "e.int64": torch.randint(-(2**40), 2**40, (2, 2), generator=gen),
        "f.bool": torch.rand(17, generator=gen) > 0.5,
        "g.empty": torch.empty(0, 8),
        "h.scalar": torch.tensor(3.25, dtype=torch.float64),
        "i.uint8": torch.arange(256, dtype=torch.uint8).reshape(16, 16),
    }


def raw(t: torch.Tensor):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def write(path: str, tensors: dict[str, torch.Tensor], metadata=None) -> str:
    with PackWriter(path, metadata=metadata or {}) as w:
        for i, (name, t) in enumerate(tensors.items()):
            w.add(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), raw(t), group=i // 3)
    return path


def test_round_trip_keeps_every_dtype_shape_and_byte_in_order(tmp_path):
    tensors = sample_tensors()
    path = write(
        str(tmp_path / "m.cbpack"),
        tensors,
        {"model_digest": "abc", "dtype": "mixed", "layout_version": 1},
    )
    pack = read_pack(path)
    assert [e.name for e in pack.entries] == list(tensors)
    assert pack.metadata == {"model_digest": "abc", "dtype": "mixed", "layout_version": 1}
    assert pack.data_offset % ALIGNMENT == 0 and pack.data_end % ALIGNMENT == 0
    assert pack.file_size == os.path.getsize(path)
    data = Path(path).read_bytes()
    for i, (e, (name, t)) in enumerate(zip(pack.entries, tensors.items())):
        assert e.offset % ALIGNMENT == 0, name
        assert e.dtype == str(t.dtype).removeprefix("torch.") and e.shape == tuple(t.shape)
        assert e.nbytes == t.numel() * t.element_size() and e.group == i // 3
        chunk = bytearray(data[e.offset : e.offset + e.nbytes])
        back = (
            torch.frombuffer(chunk, dtype=t.dtype).reshape(t.shape)
            if chunk
            else torch.empty(t.shape, dtype=t.dtype)
        )
        assert torch.equal(back, t), name
    for prev, nxt in zip(pack.entries, pack.entries[1:]):
        assert prev.offset + prev.nbytes <= nxt.offset  # in the order given, never overlapping


def test_writer_refuses_bad_entries_naming_the_field(tmp_path):
    with PackWriter(str(tmp_path / "x.cbpack")) as w:
        with pytest.raises(ValueError, match="nbytes"):
            w.add("t", "float32", (2, 2), b"\0" * 12)
        with pytest.raises(ValueError, match="dtype"):
            w.add("t", "complex32", (1,), b"\0" * 4)
        w.add("t", "float32", (1,), b"\0" * 4)
        with pytest.raises(ValueError, match="name"):
            w.add("t", "float32", (1,), b"\0" * 4)
    assert [e.name for e in read_pack(str(tmp_path / "x.cbpack")).entries] == ["t"]


@pytest.mark.parametrize("cut", [1, ALIGNMENT, 100])
def test_a_truncated_pack_is_refused(tmp_path, cut):
    path = write(str(tmp_path / "m.cbpack"), sample_tensors())
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - cut)
    with pytest.raises(PackError, match="truncated"):
        read_pack(path)


def test_a_damaged_header_or_index_is_refused(tmp_path):
    path = write(str(tmp_path / "m.cbpack"), sample_tensors())
    good = Path(path).read_bytes()
    for pos in (3, 20, len(good) - 5):  # magic, header fields, index body
        bad = bytearray(good)
        bad[pos] ^= 0xFF
        Path(path).write_bytes(bytes(bad))
        with pytest.raises(PackError):
            read_pack(path)
    Path(path).write_bytes(b"\0" * len(good))  # what a torn write without its header looks like
    with pytest.raises(PackError, match="magic"):
        read_pack(path)


def test_an_exception_mid_write_leaves_no_file(tmp_path):
    path = tmp_path / "m.cbpack"
    with pytest.raises(RuntimeError):
        with PackWriter(str(path)) as w:
            w.add("a", "uint8", (4,), b"abcd")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_writer_killed_mid_pack_leaves_nothing_valid_and_the_next_writer_succeeds(tmp_path):
    path = tmp_path / "packs" / "m.cbpack"
    child = textwrap.dedent(f"""
        import sys, time
        from cache.pack import PackWriter
        with PackWriter({str(path)!r}, metadata={{"k": 1}}) as w:
            for i in range(1000):
                w.add(f"t{{i}}", "uint8", (1 << 20,), bytes(1 << 20))
                if i == 3:
                    w._file.flush()
                    print("midway", flush=True)
                    time.sleep(60)
    """)
    kill_when_midway(child)
    leftovers = os.listdir(path.parent)
    # the dead writer's temp only
    assert len(leftovers) == 1 and leftovers[0].startswith(".m.cbpack.tmp-")
    assert os.path.getsize(path.parent / leftovers[0]) >= 4 << 20
    with pytest.raises(FileNotFoundError):
        read_pack(str(path))
    assert find_packs(str(path.parent)) == []
    # the next writer removes the dead one's temp and publishes
    write(str(path), {"x": torch.ones(3)})
    assert os.listdir(path.parent) == ["m.cbpack"]
    assert [e.name for e in read_pack(str(path)).entries] == ["x"]


def test_the_stream_picks_the_pack_the_engine_will_load(tmp_path):
    """Several packs of one checkpoint (bf16, fp16, FP8 after a QUANTIZATION change): before torch,
    the start picks the one its dtype and quantization settings name, not the newest; the names are
    the engine's own (engine.models.weights.pack_path)."""
    from safetensors.torch import save_file

    from engine.models.weights import pack_path

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    model = str(tmp_path)
    bf16 = pack_path(model, torch.bfloat16)
    fp16 = pack_path(model, torch.float16)
    fp8 = pack_path(model, torch.bfloat16, quantization="fp8")
    os.makedirs(os.path.dirname(bf16))
    for age, path in enumerate([fp8, fp16, bf16]):  # fp8 the newest, bf16 the oldest
        Path(path).touch()
        os.utime(path, ns=(10**18 - age * 10**9, 10**18 - age * 10**9))
    packs = os.path.dirname(bf16)
    assert find_packs(packs) == [fp8, fp16, bf16]
    assert find_packs(packs, want=("auto", None))[0] == fp16  # the newest unquantized
    assert find_packs(packs, want=("bfloat16", None))[0] == bf16
    assert find_packs(packs, want=("half", None))[0] == fp16
    assert find_packs(packs, want=("auto", "fp8"))[0] == fp8
    # nothing named for the settings (an FP8 checkpoint, QUANTIZATION unset): the newest
    os.remove(fp16)
    os.remove(bf16)
    assert find_packs(packs, want=("auto", None)) == [fp8]


def test_tensor_parallel_ranks_stream_the_pack_the_engine_will_load(monkeypatch):
    # rank 0 streams the pack named for the engine's dtype and quantization settings; ranks 1..N-1,
    # started by warmup.ranks.launch, are handed the same choice on their command line
    import engine.distributed.follower as follower
    import engine.distributed.launch as rank_launch
    import warmup.ranks as ranks
    from cache import device_stream

    started: dict = {}
    monkeypatch.setattr(
        rank_launch,
        "start_ranks",
        lambda size, kind, entry, entry_args: (
            started.update(size=size, entry=entry, entry_args=entry_args) or _NoDeaths()
        ),
    )
    ranks.launch("/models/m", 2, "cuda", ("bfloat16", "fp8"))
    assert started["entry"] == "warmup.ranks"

    streams: list = []
    monkeypatch.setattr(device_stream, "start", lambda *a, **k: streams.append((a, k)))
    monkeypatch.setattr(follower, "main", lambda argv: None)
    ranks.main(["--rank", "1", "--size", "2", "--device", "cuda:1", *started["entry_args"]])
    assert streams == [(("/models/m", "cuda:1"), {"shard": (1, 2), "want": ("bfloat16", "fp8")})]


class _NoDeaths:
    def on_death(self, callback) -> None:
        pass
