"""engine.cuda_graphs.CaptureQueue, the capture thread the decode graphs and the prompt steps'
piecewise graphs share (CPU: the queue's own rules, with captures that record what ran where), and
the graph sets going with their last reference: the engine freezes the cyclic GC's objects at the
end of its start, so a graph set caught in a cycle would keep the model and the KV cache on the
device after the engine is dropped (found on an H200: a second engine in one process found the
first one's 64.6 GiB KV cache still allocated;
bench/results/2026-11-28-h200-decode-prefetch/README.md)."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref

from engine.cuda_graphs import CaptureQueue


def _wait_idle(queue: CaptureQueue, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while queue.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not queue.pending()


class Owner:
    """A queue's owner as the graph sets are to it (engine.cuda_graphs.CaptureOwner): `capture`
    runs for a size, `failures` collects what capture_failed is told (and turns background off, as
    the graph sets do)."""

    def __init__(self, capture) -> None:
        self.background = True
        self.captured: dict[int, str] = {}
        self.failures: list[tuple[int, str]] = []
        self._capture = capture

    def capture_queued(self, size: int) -> None:
        self._capture(size)
        self.captured[size] = threading.current_thread().name

    def has_graph(self, size: int) -> bool:
        return size in self.captured

    def capture_failed(self, size: int, exc: Exception) -> None:
        self.failures.append((size, str(exc)))
        self.background = False  # later sizes go back to their step


def test_sizes_are_captured_once_in_order_on_the_named_thread() -> None:
    order: list[int] = []
    gate = threading.Event()

    def capture(size: int) -> None:
        gate.wait(10)  # the first capture holds the thread while more sizes are queued
        order.append(size)

    owner = Owner(capture)
    queue = CaptureQueue("test-captures", owner)
    for size in (8, 4, 8, 16, 4):
        queue.request(size)
    assert queue.pending() == [8, 4, 16]
    gate.set()
    _wait_idle(queue)
    assert order == [8, 4, 16]
    assert set(owner.captured.values()) == {"test-captures"} and not owner.failures
    queue.request(4)  # captured already: nothing queued
    assert queue.pending() == []


def test_a_failure_is_reported_and_a_disabled_queue_drops_the_rest() -> None:
    ran: list[int] = []
    gate = threading.Event()

    def capture(size: int) -> None:
        gate.wait(10)
        ran.append(size)
        if size == 2:
            raise RuntimeError("capture failed")

    owner = Owner(capture)
    queue = CaptureQueue("test-failing", owner)
    for size in (2, 3, 5):
        queue.request(size)
    gate.set()
    _wait_idle(queue)
    assert owner.failures == [(2, "capture failed")]
    assert ran == [2]  # 3 and 5 were dropped once the owner turned background off
    owner.background = True
    queue.request(3)  # a new thread starts for a later request
    _wait_idle(queue)
    assert ran == [2, 3]


def test_a_background_failure_is_one_warning_naming_what_and_what_follows(caplog) -> None:
    """The decode graphs' and the piecewise graphs' handlers both log through
    log_background_failure: what was being captured, the exception, what happens instead."""
    import logging

    from engine.cuda_graphs import log_background_failure

    with caplog.at_level(logging.WARNING, logger="engine.cuda_graphs"):
        later = "sizes not captured yet are captured in their first step"
        log_background_failure("batch size 8", later, RuntimeError("out of memory"))
    (record,) = caplog.records
    assert record.getMessage() == (
        "CUDA graphs: capturing batch size 8 in the background failed (RuntimeError: out of "
        "memory); sizes not captured yet are captured in their first step"
    )


@contextlib.contextmanager
def _collector_off():
    """Objects freed only by their reference counts inside, as the engine's frozen ones are."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_the_queue_holds_its_owner_weakly() -> None:
    owner = Owner(lambda size: None)
    owner.queue = CaptureQueue("test-weak", owner)  # the owner holds its queue, as graph sets do
    queue, gone = owner.queue, weakref.ref(owner)
    with _collector_off():
        del owner
        assert gone() is None
    queue.request(4)  # its owner gone: nothing is queued, no thread starts
    assert queue.pending() == []


def test_graph_sets_go_with_their_last_reference_while_the_gc_is_frozen(smollm2_dir) -> None:
    """The decode graphs and the piecewise graphs, built as a GPU engine's runner builds them (here
    around a CPU engine's model, KV cache and input stager: nothing is captured), then the GC's
    objects frozen as engine/core.py freezes them: dropping each frees it, with the KV cache it
    holds."""
    from engine import LLM
    from engine.attention.torch_ref import TorchAttentionBackend
    from engine.cuda_graphs import DecodeGraphs
    from engine.piecewise_graphs import PiecewiseGraphs

    llm = LLM(model=smollm2_dir, dtype="float32", device="cpu", max_model_len=512)
    runner = llm.engine.runner
    kv_cache = weakref.ref(runner.kv_cache)
    decode = DecodeGraphs(
        runner.model,
        runner.kv_cache,
        runner.stager,
        [1, 2, 4],
        512,
        runner.block_size,
        runner.model_config.vocab_size,
    )
    pieces = PiecewiseGraphs(
        runner.model,
        TorchAttentionBackend(),
        runner.kv_cache,
        runner.stager,
        runner.local_config,
        [16, 32],
        8,
        decode.table_width,
    )
    sets = [weakref.ref(decode), weakref.ref(pieces)]
    del runner
    gc.freeze()
    try:
        with _collector_off():
            del decode, pieces
            assert [s() for s in sets] == [None, None]
            del llm
            assert kv_cache() is None
    finally:
        gc.unfreeze()
