"""engine.cuda_graphs.CaptureQueue, the capture thread the decode graphs and the prompt steps'
piecewise graphs share (CPU: the queue's own rules, with captures that record what ran where)."""

from __future__ import annotations

import threading
import time

from engine.cuda_graphs import CaptureQueue


def _wait_idle(queue: CaptureQueue, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while queue.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not queue.pending()


def test_sizes_are_captured_once_in_order_on_the_named_thread() -> None:
    captured: dict[int, str] = {}
    order: list[int] = []
    gate = threading.Event()

    def capture(size: int) -> None:
        gate.wait(10)  # the first capture holds the thread while more sizes are queued
        order.append(size)
        captured[size] = threading.current_thread().name

    def failed(size: int, exc: Exception) -> None:
        raise AssertionError(f"size {size}: {exc}")

    queue = CaptureQueue("test-captures", capture, lambda: True, captured.__contains__, failed)
    for size in (8, 4, 8, 16, 4):
        queue.request(size)
    assert queue.pending() == [8, 4, 16]
    gate.set()
    _wait_idle(queue)
    assert order == [8, 4, 16]
    assert set(captured.values()) == {"test-captures"}
    queue.request(4)  # captured already: nothing queued
    assert queue.pending() == []


def test_a_failure_is_reported_and_a_disabled_queue_drops_the_rest() -> None:
    state = {"enabled": True}
    failures: list[tuple[int, str]] = []
    ran: list[int] = []
    gate = threading.Event()

    def capture(size: int) -> None:
        gate.wait(10)
        ran.append(size)
        if size == 2:
            raise RuntimeError("capture failed")

    def failed(size: int, exc: Exception) -> None:
        failures.append((size, str(exc)))
        state["enabled"] = False  # as the graphs do: later sizes go back to their step

    queue = CaptureQueue("test-failing", capture, lambda: state["enabled"], lambda s: False, failed)
    for size in (2, 3, 5):
        queue.request(size)
    gate.set()
    _wait_idle(queue)
    assert failures == [(2, "capture failed")]
    assert ran == [2]  # 3 and 5 were dropped once the queue was disabled
    state["enabled"] = True
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
