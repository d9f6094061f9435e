"""A packed step's way to the device (engine.step_transfer's kernel, engine.step_inputs): the words
arrive unchanged, the ids only the device holds go into their input rows (a run of rows by the
kernel, any other pattern after it), on the GPU from the pinned buffer, and under Triton's CPU
interpreter."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from child_process import run_in_triton_interpreter
from engine.step_inputs import (
    InputStager,
    PendingIds,
    StepLayout,
    input_ids_view,
    input_ids_word,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton"
)

# pending ids (dst rows, src rows): a run, another order, none
PENDING_CASES = pytest.mark.parametrize(
    "dst, src",
    [([0, 1, 2], [1, 2, 3]), ([2, 0], [0, 3]), (None, None)],
    ids=["run", "any", "none"],
)
# (dst0, src0, count) runs: none, inside the first program, across a program's edge, at the end
RUNS = ((0, 0, 0), (3, 1, 4), (1020, 0, 9), (2500 - 5, 2, 5))

INTERPRETER_SCRIPT = """
import torch
from engine import step_transfer

gen = torch.Generator().manual_seed(0)
host = torch.randint(-(2**62), 2**62, (2500,), generator=gen)  # 2 whole programs and a part
tokens = torch.randint(0, 1 << 40, (16,), generator=gen)
for dst0, src0, count in RUNS:
    dest = torch.full_like(host, -7)
    step_transfer.send(host, dest, tokens, (dst0, src0, count))
    want = host.clone()
    want[dst0 : dst0 + count] = tokens[src0 : src0 + count]
    assert torch.equal(dest, want), (dst0, src0, count)
dest = torch.zeros_like(host)
step_transfer.send(host, dest)  # no tokens at all
assert torch.equal(dest, host)
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_kernel_in_the_triton_interpreter() -> None:
    script = f"RUNS = {RUNS!r}\n" + textwrap.dedent(INTERPRETER_SCRIPT)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_pending_ids_find_their_run() -> None:
    tokens = torch.arange(10, 20)
    assert PendingIds([4, 5, 6], [2, 3, 4], tokens).run == (4, 2, 3)
    assert PendingIds([4], [7], tokens).run == (4, 7, 1)
    assert PendingIds([4, 5], [3, 2], tokens).run is None  # rows swapped
    assert PendingIds([4, 6], [2, 3], tokens).run is None  # a gap


class _IdsSecond(StepLayout):
    """A layout whose input_ids follow positions (the engine's put them first)."""

    def sections(self):
        first, second, *rest = super().sections()
        return [second, first, *rest]


@pytest.mark.parametrize("layout_type", [StepLayout, _IdsSecond])
def test_the_kernel_addresses_input_ids_where_the_view_finds_them(layout_type) -> None:
    """The int64 word the send path hands the kernel for input_ids' first row is the view's,
    wherever the section lies."""
    layout = layout_type(num_tokens=5, num_seqs=3, table_width=2)
    size = layout.offsets()[1]
    buf = torch.arange(size, dtype=torch.uint8)
    words = buf[: size // 8 * 8].view(torch.int64)
    first = input_ids_word(layout)
    assert (first > 0) == (layout_type is _IdsSecond)
    assert torch.equal(words[first : first + 5], input_ids_view(buf, layout))


@pytest.mark.parametrize(
    "dst, src", [([0, 1, 2], [1, 2, 3]), ([2, 0], [0, 3]), ([1], [2])], ids=["run", "any", "one"]
)
def test_the_cpu_step_takes_its_pending_ids(dst: list[int], src: list[int]) -> None:
    stager = InputStager(torch.device("cpu"), block_size=4)
    tokens = torch.tensor([50, 51, 52, 53])
    step = stager.stage(
        [0, 0, 0], [5, 6, 2], [5, 6, 2], [1, 1, 1], [[0, 1], [2, 3], [4]],
        pending=PendingIds(dst, src, tokens),
    )  # fmt: skip
    want = [0, 0, 0]
    for d, s in zip(dst, src):
        want[d] = int(tokens[s])
    assert step.input_ids.tolist() == want
    assert step.positions.tolist() == [5, 6, 2]


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("transfer", [True, False], ids=["kernel", "copy-engine"])
@PENDING_CASES
def test_the_device_step_equals_the_host_packing(transfer: bool, dst, src, monkeypatch) -> None:
    """Decode graphs' static buffer and a fresh one, several steps in a row (both pinned buffers
    in turn): every byte as the host packed it, the pending ids in their rows."""
    from engine import step_transfer

    monkeypatch.setattr(step_transfer, "ENABLED", transfer)
    device = torch.device("cuda")
    stager, host_stager = InputStager(device, 16), InputStager(torch.device("cpu"), 16)
    tokens = torch.tensor([90, 91, 92, 93], device=device)
    layout = StepLayout(4, 4, 300)
    _, nbytes = layout.offsets()
    static = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for step in range(4):
        ids = [7 + step, 8, 9]
        tables = [list(range(300)), [5 + step], [6, 7]]
        args = (ids, [3, 0, 17], [3, 0, 17], [1, 1, 1], tables)
        kw = dict(table_width=300, pad_to=4, max_seq_len=4096)
        pending = None if dst is None else PendingIds(dst, src, tokens)
        for dest in (static, None):
            got = stager.stage(*args, **kw, dest=dest, pending=pending)
            want = host_stager.stage(*args, **kw)
            if pending is not None:
                for d, s in zip(dst, src):
                    want.input_ids[d] = int(tokens[s])
            torch.cuda.synchronize()
            assert torch.equal(got.input_ids.cpu(), want.input_ids)
            assert torch.equal(got.meta.block_tables.cpu(), want.meta.block_tables)
            assert torch.equal(got.meta.slot_mapping.cpu(), want.meta.slot_mapping)
            assert torch.equal(got.meta.seq_lens.cpu(), want.meta.seq_lens)
    assert torch.equal(input_ids_view(static, layout).cpu(), got.input_ids.cpu())


# Triton's CUDA launcher (triton/backends/nvidia/driver.py, getPointer) raises this ValueError when
# cuPointerGetAttribute finds no device address for a pointer argument (pageable host memory).
TRITON_UNMAPPED = "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"


class _Raising:
    """Stands in for the compiled kernel: its launch raises what Triton's launcher raises."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise ValueError(self.message)

        return launch


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_unaddressable_host_memory_turns_the_kernel_off(monkeypatch, caplog) -> None:
    from engine import step_transfer

    monkeypatch.setattr(step_transfer, "_host_readable", [True])
    monkeypatch.setattr(step_transfer, "_send_kernel", _Raising(TRITON_UNMAPPED))
    words = torch.zeros(4, dtype=torch.int64)
    with caplog.at_level("WARNING", logger="engine.step_transfer"):
        assert step_transfer.send(words, words) is False
    assert step_transfer._host_readable == [False]
    assert "copy engine" in caplog.text
    monkeypatch.setattr(step_transfer, "_send_kernel", _Raising("some other launch error"))
    with pytest.raises(ValueError, match="other launch error"):
        step_transfer.send(words, words)


@pytest.mark.gpu
@needs_cuda_triton
def test_pageable_host_memory_is_refused_by_the_launcher(monkeypatch) -> None:
    """The real launcher on pageable memory: send() launches nothing and says so; the stager then
    copies."""
    from engine import step_transfer

    monkeypatch.setattr(step_transfer, "_host_readable", [True])
    dest = torch.full((16,), -1, dtype=torch.int64, device="cuda")
    assert step_transfer.send(torch.arange(16), dest) is False
    assert not step_transfer.applies(dest, 1)
    assert torch.equal(dest.cpu(), torch.full((16,), -1))


def _send_in_torch(host_words, dest_words, tokens=None, run=(0, 0, 0)) -> bool:
    """engine.step_transfer.send's contract, in torch on CPU tensors (the kernel itself is checked
    under the interpreter above and on the GPU)."""
    dest_words.copy_(host_words)
    dst0, src0, count = run
    if count:
        dest_words[dst0 : dst0 + count] = tokens[src0 : src0 + count]
    return True


@pytest.mark.parametrize("refused", [False, True], ids=["kernel", "launch-refused"])
@PENDING_CASES
def test_the_send_path_puts_every_pending_id_in(refused: bool, dst, src, monkeypatch) -> None:
    """engine.step_inputs._send's choice between the kernel and the copy engine, on CPU tensors
    (applies() forced): the bytes arrive and every pending id is in its row, whether the kernel put
    in a run, the stager wrote the ids after it, or a refused launch left it all to the copy."""
    from engine import step_inputs, step_transfer

    monkeypatch.setattr(step_transfer, "applies", lambda dest, num_tokens: True)
    refuse = lambda *args: False  # noqa: E731 - a launch Triton refused: nothing moved
    monkeypatch.setattr(step_transfer, "send", refuse if refused else _send_in_torch)
    layout = StepLayout(4, 4, 300)
    packed = InputStager(torch.device("cpu"), 16).stage(
        [7, 8, 9], [3, 0, 17], [3, 0, 17], [1, 1, 1], [list(range(300)), [5], [6, 7]],
        table_width=300, pad_to=4,
    )  # fmt: skip
    _, nbytes = layout.offsets()
    host = packed.input_ids.untyped_storage()
    host = torch.frombuffer(bytearray(host), dtype=torch.uint8)[:nbytes]
    dest = torch.zeros(nbytes, dtype=torch.uint8)
    tokens = torch.tensor([90, 91, 92, 93])
    pending = None if dst is None else PendingIds(dst, src, tokens)
    step_inputs._send(host, dest, layout, pending)
    want = host.clone()
    if pending is not None:
        ids = input_ids_view(want, layout)
        for d, s in zip(dst, src):
            ids[d] = tokens[s]
    assert torch.equal(dest, want)
