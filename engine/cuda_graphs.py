"""CUDA graphs of the decode step (model forward + logits) at a few batch sizes, in one shared pool,
captured at start or lazily (a size on its first step).

A decode batch is padded up to the next captured size; its inputs are copied into the graph's static
buffer, then the graph replays. Padded rows have seq_len 0 and slot -1: attention writes nothing for
them and returns zeros.

Lazy capture in the background (`background` on; the worker's warm-up turns it on at ready): a step
whose size has no graph yet replays a larger captured graph, or runs eagerly at its size (which
loads the size's kernels on the step loop, as an eager step would), while another thread captures
that size (capture records, it runs nothing), so no step waits for a capture. A size is queued once
its kernels are loaded: after its first eager step, or at once when `kernels_loaded` says the
worker's whole kernel set is (warmup.ready sets it).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.step_inputs import InputStager, PendingIds, StepLayout, StepTensors, views

log = logging.getLogger(__name__)


def smallest_at_least(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` >= n (the graph a step of n pads up to), or None when n
    is bigger than every size."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def primed_stream(device: torch.device, dtype: torch.dtype) -> torch.cuda.Stream:
    """A new side stream on which this thread's cuBLAS handle and workspace exist already (a
    matmul with a bias in `dtype` has run on it), so a capture on it allocates neither."""
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        x = torch.zeros(32, 32, dtype=dtype, device=device)
        torch.nn.functional.linear(x, x, x[0])
    stream.synchronize()
    return stream


def log_background_failure(what: str, later: str, exc: Exception) -> None:
    """The warning of a capture thread's failure: `what` it was capturing, what happens `later`
    (its owner turns background capture off)."""
    log.warning(
        "CUDA graphs: capturing %s in the background failed (%s: %s); %s",
        what,
        type(exc).__name__,
        exc,
        later,
    )


class CaptureOwner(Protocol):
    """What a CaptureQueue asks of the graphs it captures for (DecodeGraphs, PiecewiseGraphs)."""

    background: bool  # queued sizes are still wanted (False: the queue drops the rest)

    def capture_queued(self, size: int) -> None:
        """Capture `size`'s graph, on the queue's thread."""

    def has_graph(self, size: int) -> bool:
        """Whether `size` has its graph already (nothing to queue)."""

    def capture_failed(self, size: int, exc: Exception) -> None:
        """`size`'s capture raised `exc`; the owner's steps go on without that graph."""


class CaptureQueue:
    """Sizes waiting for a capture thread of their own: started when a size is queued and none
    runs, ended when the queue is empty or the owner's `background` turns false. The owner's
    `capture_queued(size)` runs there, one size at a time; an exception from it goes to
    `capture_failed(size, exc)`.

    The queue holds its owner weakly. The owner holds the queue, and the engine freezes the cyclic
    GC's objects at the end of its start (engine/core.py), so a cycle between them would keep the
    owner, and the model and the KV cache it captures with, on the device after the engine is
    dropped; the owner goes with its last reference instead, and its queue stops."""

    def __init__(self, name: str, owner: CaptureOwner) -> None:
        self.name = name
        self._owner = weakref.ref(owner)
        self._lock = threading.Lock()
        self._queue: list[int] = []
        self._worker: threading.Thread | None = None

    def request(self, size: int) -> None:
        """Queue `size` (once), starting the thread when none runs."""
        owner = self._owner()
        with self._lock:
            if owner is None or size in self._queue or owner.has_graph(size):
                return
            self._queue.append(size)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._worker.start()

    def pending(self) -> list[int]:
        """The sizes queued or being captured."""
        with self._lock:
            return list(self._queue)

    def _run(self) -> None:
        while True:
            owner = self._owner()  # held for one capture at a time
            with self._lock:
                if not self._queue or owner is None or not owner.background:
                    self._queue.clear()
                    self._worker = None
                    return
                size = self._queue[0]
            try:
                owner.capture_queued(size)
            except Exception as exc:  # the caller's steps go on without this size's graph
                owner.capture_failed(size, exc)
            finally:
                del owner
                with self._lock:
                    self._queue.remove(size)


class DecodeGraphs:
    """One CUDA graph per batch size; logits land in one static [max size, vocab] float32 buffer."""

    def __init__(
        self,
        model,
        kv_cache: torch.Tensor,
        stager: InputStager,
        sizes: Sequence[int],
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        capture_error_mode: str = "global",
    ) -> None:
        """capture_error_mode "thread_local" (tensor parallelism): CUDA calls of other threads, such
        as the NCCL watchdog's event queries, do not invalidate a capture."""
        self.model = model
        self.capture_error_mode = capture_error_mode
        self.kv_cache = kv_cache
        self.stager = stager
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        # a sequence can hold at most this many blocks
        self.table_width = -(-max_model_len // block_size)
        self.device = kv_cache.device
        self.logits = torch.empty(
            self.sizes[-1], vocab_size, dtype=torch.float32, device=self.device
        )
        self.pool = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[int, torch.Tensor] = {}  # size -> the graph's static packed input buffer
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        # Background capture (see the module's docstring); kernels_loaded: every size's kernels are
        # in the JIT's cache with their modules on the GPU. The worker's warm-up sets both.
        self.background = False
        self.kernels_loaded = False
        self._warmed: set[int] = set()  # sizes whose first (eager) step ran (kernels loaded)
        self._lock = threading.Lock()  # the dicts above
        self._capturing = threading.Lock()  # one capture at a time into the shared pool
        self._captures = CaptureQueue("coldbrew-graph-capture", self)
        # size -> its packed inputs for steps run eagerly
        self._eager_inputs: dict[int, torch.Tensor] = {}
        self._primed = threading.local()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, batch: int) -> int | None:
        """The smallest captured size >= batch, or None when the batch is bigger than every
        graph."""
        return smallest_at_least(self.sizes, batch)

    def _stage_padding(self, size: int, dest: torch.Tensor | None) -> StepTensors:
        """Inputs of `size` padded rows only (used to warm up and capture)."""
        return self.stager.stage(
            [],
            [],
            [],
            [],
            [],
            table_width=self.table_width,
            pad_to=size,
            dest=dest,
            max_seq_len=self.max_model_len,
        )

    @torch.inference_mode()
    def capture(self, sizes: Sequence[int] | None = None) -> None:
        """Capture every size (or only `sizes`: run() captures a size lazily on its first step),
        largest first, so the smaller graphs reuse the pool's blocks."""
        with self._capturing:
            self._capture_inline(sizes)

    def _capture_inline(self, sizes: Sequence[int] | None) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # capture needs a side stream; torch.cuda.graph's also runs a full gc.collect() +
        # empty_cache() per graph, which we skip
        stream = torch.cuda.Stream(self.device)
        todo = sorted(
            {s for s in (self.sizes if sizes is None else sizes) if s not in self.graphs},
            reverse=True,
        )
        for size in todo:
            _, nbytes = StepLayout(size, size, self.table_width).offsets()
            dest = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            step = self._stage_padding(size, dest)
            graph = torch.cuda.CUDAGraph()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                # Warm-up on the capture stream, outside the graph: compiles the Triton kernels for
                # these shapes and sets up cuBLAS (and its workspace) for this stream.
                self._forward(step, size)
                stream.synchronize()
                graph.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)
                try:
                    self._forward(step, size)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            with self._lock:
                self.inputs[size] = dest
                self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.pool_bytes += torch.cuda.memory_allocated(self.device) - before
        self.capture_seconds += time.perf_counter() - t0
        log.info(
            "CUDA graphs: captured decode batch sizes %s in %.2f s "
            "(%.0f MiB of graph memory and static buffers "
            "in all)",
            ",".join(map(str, todo)),
            time.perf_counter() - t0,
            self.pool_bytes / (1 << 20),
        )

    def _forward(self, step: StepTensors, size: int) -> None:
        hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
        self.model.compute_logits(hidden, out=self.logits[:size])

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        starts: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        pending: PendingIds | None = None,
    ) -> torch.Tensor:
        """One decode step of len(token_ids) one-token sequences -> their logits [B, vocab] (a view
        of the static buffer, valid until the next replay). pending: input ids that are only on the
        device (InputStager.stage's)."""
        batch = len(token_ids)
        size = self.padded_size(batch)
        if size is None:
            raise ValueError(
                f"batch: {batch} sequences exceed the largest captured CUDA graph ({self.max_size})"
            )
        if size not in self.graphs:
            if not self.background:
                self.capture([size])
            else:
                if size in self._warmed or self.kernels_loaded:
                    self._captures.request(size)
                larger = self.sizes[self.sizes.index(size) :]
                replay = next((s for s in larger if s in self.graphs), None)
                if replay is None:  # no larger graph yet either: this step runs eagerly
                    logits = self._run_eager(
                        batch, token_ids, positions, starts, block_tables, pending
                    )
                    if size not in self._warmed:  # its kernels are loaded now
                        self._warmed.add(size)
                        self._captures.request(size)
                    return logits
                size = replay
        self.stager.stage(
            token_ids,
            positions,
            starts,
            [1] * batch,
            block_tables,
            table_width=self.table_width,
            pad_to=size,
            dest=self.inputs[size],
            max_seq_len=self.max_model_len,
            want_views=False,
            pending=pending,
        )
        self.graphs[size].replay()
        return self.logits[:batch]

    def _run_eager(
        self, batch, token_ids, positions, starts, block_tables, pending
    ) -> torch.Tensor:
        """One decode step without a graph, padded to its size as the graph would be (the same
        kernels)."""
        size = self.padded_size(batch)
        dest = self._eager_inputs.get(size)
        if dest is None:
            _, nbytes = StepLayout(size, size, self.table_width).offsets()
            dest = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._eager_inputs[size] = dest
        step = self.stager.stage(
            token_ids,
            positions,
            starts,
            [1] * batch,
            block_tables,
            table_width=self.table_width,
            pad_to=size,
            dest=dest,
            max_seq_len=self.max_model_len,
            pending=pending,
        )
        self._forward(step, size)
        return self.logits[:batch]

    # ---- background capture
    # ------------------------------------------------------------------------------------
    def capture_queued(self, size: int) -> None:
        """On the capture thread: the size's graph (its kernels are loaded)."""
        with self._capturing:
            if size not in self.graphs:
                self._capture_background(size)

    def has_graph(self, size: int) -> bool:
        """Whether batch size `size` has its graph."""
        return size in self.graphs

    def capture_failed(self, size: int, exc: Exception) -> None:
        """Steps go on eager or from larger graphs; later sizes are captured inline."""
        self.background = False
        later = "sizes not captured yet are captured in their first step"
        log_background_failure(f"batch size {size}", later, exc)

    @torch.inference_mode()
    def _capture_background(self, size: int) -> None:
        """Capture one size on this (non-step) thread: no warm-up run (an eager step or the worker's
        warm-up loaded the kernels; cuBLAS is primed on the capture stream once per thread), and
        thread-local capture, so the step loop's own CUDA calls stay legal meanwhile."""
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = getattr(self._primed, "stream", None)
        if stream is None:
            # an FP8 KV cache has no cuBLAS mm: the handle is primed in bf16
            fp8 = self.kv_cache.element_size() == 1
            stream = primed_stream(self.device, torch.bfloat16 if fp8 else self.kv_cache.dtype)
            self._primed.stream = stream
        layout = StepLayout(size, size, self.table_width)
        _, nbytes = layout.offsets()
        # run() stages all of it before a replay
        dest = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        step = views(dest, layout, self._padding_meta(size))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self._forward(step, size)
            finally:
                graph.capture_end()
        with self._lock:
            self.inputs[size] = dest
            self.graphs[size] = graph
        seconds = time.perf_counter() - t0
        self.capture_seconds += seconds
        log.info(
            "CUDA graphs: captured decode batch size %d in the background in %.3f s", size, seconds
        )

    def _padding_meta(self, size: int) -> dict:
        """The host half of the metadata the stager gives `size` padding rows (what a capture's
        launches read)."""
        return dict(
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[0] * size,
            block_size=self.stager.block_size,
        )
