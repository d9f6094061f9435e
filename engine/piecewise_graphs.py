"""CUDA graphs of the steps that carry prompt tokens (prefill and mixed steps), cut at attention.

A step of T tokens runs padded up to the next token bucket. A bucket's forward is captured as
num_layers + 1 graphs: the embedding and the first layer up to its attention; then each layer's
o_proj and MLP with the next layer up to its attention; then the last layer's rest and the final
norm. Attention runs eagerly between the replays with the step's own metadata (its launches follow
the step's sequences and lengths), reading q from and writing into static buffers that every bucket
shares. Padding tokens belong to no sequence (id 0, position 0, slot -1): nothing of theirs reaches
the KV cache or a real token's attention, and outside attention rows never mix, so a real token's
values are those of an eager step.

What it saves is host time: an eager step pays Python over every layer, every launch and cuBLAS's
heuristics at each new M; a replayed step pays one launch per graph plus the attention launches.

A bucket's first step runs eagerly at the bucket's size (that compiles its kernels and primes cuBLAS
for its shapes, which a capture needs); its second step captures it (recording only), then replays.
With `background` on (warmup.ready turns it on at ready), that capture happens on a thread of its
own instead, while the bucket's steps go on eagerly: no step waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from engine.cuda_graphs import (
    CaptureQueue,
    log_background_failure,
    primed_stream,
    smallest_at_least,
)
from engine.memory_budget import FRAGMENTATION, layer_activation_bytes
from engine.step_inputs import InputStager, StepLayout, StepTensors, views

log = logging.getLogger(__name__)

# Token counts captured: fine steps where prompt chunks land, so padding wastes little compute.
MAX_TOKENS = 2048
BUCKETS = (16, 32, 64, 128, *range(256, MAX_TOKENS + 1, 128))


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """The token counts to capture for steps of at most max_num_batched_tokens tokens: the buckets
    below it, then it (rounded up to 16) when it is under MAX_TOKENS."""
    limit = min(max_num_batched_tokens, MAX_TOKENS)
    below = [b for b in BUCKETS if b < limit]
    return below + [min(-(-limit // 16) * 16, MAX_TOKENS)]


def reserve_bytes(cfg, itemsize: int, max_tokens: int) -> int:
    """Device memory the graphs keep: their pool (one layer's activations at the largest bucket,
    the hand-offs between pieces) and the static q and attention-output buffers."""
    static = 2 * max_tokens * cfg.num_heads * cfg.head_dim * itemsize
    return int(layer_activation_bytes(cfg, itemsize, max_tokens) * FRAGMENTATION) + static


@dataclass
class _AttentionCall:
    """One layer's attention as the capture saw it, run again between replays with each step's
    metadata."""

    kv_cache_layer: torch.Tensor
    scale: float
    kwargs: dict


@dataclass
class _Bucket:
    graphs: list[torch.cuda.CUDAGraph]  # num_layers + 1 pieces
    calls: list[_AttentionCall]  # the attention between piece i and piece i + 1
    hidden: torch.Tensor  # the last piece's output [tokens, hidden]


class _StaticAttention:
    """Attention's side of the cut: q (and k, v where the backend writes the cache) copied in by a
    piece, the output read by the next; one set for every bucket, sized for the largest."""

    def __init__(self, cfg, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        d = cfg.head_dim
        self.q = torch.zeros(max_tokens, cfg.num_heads, d, dtype=dtype, device=device)
        self.out = torch.zeros_like(self.q)
        self.k = torch.zeros(max_tokens, cfg.num_kv_heads, d, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)


class _CutAtAttention:
    """Stands in for the attention backend while a bucket is captured: each call copies q (and k,
    v) into the static buffers, ends the graph being captured, records the call, begins the next
    graph and returns the static output."""

    def __init__(self, backend, static: _StaticAttention, num_tokens: int, pool) -> None:
        self.accepts_written_kv = backend.accepts_written_kv
        self.static = static
        self.num_tokens = num_tokens
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []
        self.capturing = False

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.graphs.append(graph)
        self.capturing = True

    def end(self) -> None:
        if self.capturing:
            self.capturing = False
            self.graphs[-1].capture_end()

    def forward(self, q, k, v, kv_cache_layer, meta, scale, kv_written=False, **kwargs):
        t = self.num_tokens
        self.static.q[:t].copy_(q)
        if not kv_written:
            self.static.k[:t].copy_(k)
            self.static.v[:t].copy_(v)
        self.end()
        self.calls.append(
            _AttentionCall(kv_cache_layer, scale, dict(kwargs, kv_written=kv_written))
        )
        self.begin()
        return self.static.out[:t]


class PiecewiseGraphs:
    """Graphs of prompt and mixed steps of up to max(buckets) tokens, cut at every attention."""

    def __init__(
        self,
        model,
        backend,
        kv_cache: torch.Tensor,
        stager: InputStager,
        cfg,
        buckets: list[int],
        max_num_seqs: int,
        table_width: int,
    ) -> None:
        """backend: the attention backend the model's layers share; cfg: the model's config (heads,
        KV heads, head_dim); table_width: the most blocks a sequence holds."""
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.stager = stager
        self.buckets = sorted(buckets)
        self.device = kv_cache.device
        self.static = _StaticAttention(cfg, self.max_tokens, model.dtype, self.device)
        _, nbytes = StepLayout(self.max_tokens, max_num_seqs, table_width).offsets()
        # every bucket's packed inputs: ids, positions and slots sit at offsets set by the bucket
        self.inputs = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.captured: dict[int, _Bucket] = {}
        self.warmed: set[int] = set()  # buckets whose first (eager) step has run
        self.pool = None
        self.pool_bytes = 0  # device memory the captures took (pool and outputs)
        self.background = False  # capture on a thread of its own (see the module's docstring)
        self._capturing = threading.Lock()  # one capture at a time into the pool
        self._captures = CaptureQueue("coldbrew-prompt-graphs", self)
        self._primed = threading.local()  # each capturing thread's stream, cuBLAS primed on it

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket_of(self, num_tokens: int) -> int | None:
        """The smallest bucket >= num_tokens, or None when the step is bigger than every bucket."""
        return smallest_at_least(self.buckets, num_tokens)

    def run(self, token_ids, positions, starts, lens, block_tables, pending=None):
        """One step of at most max_tokens tokens -> its hidden states [tokens, hidden] (a view of
        the graph's output, valid until the next step). pending: as DecodeGraphs.run's."""
        num_tokens = len(token_ids)
        size = self.bucket_of(num_tokens)
        if size is None:
            raise ValueError(
                f"step: {num_tokens} tokens exceed the largest piecewise bucket ({self.max_tokens})"
            )
        step = self.stager.stage(
            token_ids, positions, starts, lens, block_tables, pad_tokens_to=size, dest=self.inputs,
            pending=pending,
        )  # fmt: skip
        if size not in self.captured:
            if size in self.warmed and self.background:
                self._captures.request(size)
            elif size in self.warmed:
                self._capture(size, step, warm=False)
            if size not in self.captured:  # eager, at the bucket's shapes
                self.warmed.add(size)
                hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
                return hidden[:num_tokens]
        bucket = self.captured[size]
        static = self.static
        q, out, k, v = (x[:size] for x in (static.q, static.out, static.k, static.v))
        for graph, call in zip(bucket.graphs, bucket.calls):
            graph.replay()
            self.backend.forward(
                q, k, v, call.kv_cache_layer, step.meta, call.scale, out=out, **call.kwargs
            )
        bucket.graphs[-1].replay()
        return bucket.hidden[:num_tokens]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket not captured yet (each after an eager run at its size)."""
        for size in reversed(self.buckets):
            if size not in self.captured:
                step = self.stager.stage([], [], [], [], [], pad_tokens_to=size, dest=self.inputs)
                self._capture(size, step, warm=True)

    def _capture(self, size: int, step: StepTensors, warm: bool, where: str = "") -> None:
        """Record bucket `size` from `step`'s static views (warm: first run the forward eagerly on
        the capture stream)."""
        with self._capturing:
            if size not in self.captured:
                self._record(size, step, warm, where)

    def _record(self, size: int, step: StepTensors, warm: bool, where: str) -> None:
        t0 = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = getattr(self._primed, "stream", None)
        if stream is None:
            stream = self._primed.stream = primed_stream(self.device, self.model.dtype)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        cut = _CutAtAttention(self.backend, self.static, size, self.pool)
        with torch.cuda.stream(stream):
            if warm:
                self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
            with self.model.attention_through(cut):
                cut.begin()
                try:
                    hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
                finally:
                    cut.end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.captured[size] = _Bucket(cut.graphs, cut.calls, hidden)
        seconds = time.perf_counter() - t0
        # (in the background, what other threads allocated meanwhile is counted too)
        self.pool_bytes += torch.cuda.memory_allocated(self.device) - before
        log.info(
            "CUDA graphs: captured %d-token steps in %d pieces%s in %.3f s (%.0f MiB of graph "
            "memory for prompt steps in all)",
            size,
            len(cut.graphs),
            where,
            seconds,
            self.pool_bytes / (1 << 20),
        )

    # ---- background capture ----------------------------------------------------------------------
    def pending(self) -> list[int]:
        """The buckets queued for the capture thread or being captured there."""
        return self._captures.pending()

    def has_graph(self, size: int) -> bool:
        """Whether bucket `size` has its graphs."""
        return size in self.captured

    def capture_failed(self, size: int, exc: Exception) -> None:
        """Steps go on eagerly; later buckets are captured in their second step."""
        self.background = False
        later = "buckets not captured yet are captured in their second step"
        log_background_failure(f"{size}-token steps", later, exc)

    @torch.inference_mode()
    def capture_queued(self, size: int) -> None:
        """Record bucket `size` on this (non-step) thread. Its pieces read the token sections of the
        shared inputs buffer, whose places depend on the bucket's size alone: they are taken as
        views, not staged (the step loop stages into that buffer meanwhile). No warm-up run: the
        bucket's first step ran its kernels. Attention is cut on this thread only
        (DecoderModel.attention_through), so the steps meanwhile run their own."""
        meta_host = dict(
            num_decode_seqs=0,
            max_query_len=1,
            max_seq_len=0,
            query_start_loc_cpu=[0],
            seq_lens_cpu=[],
            block_size=self.stager.block_size,
        )
        step = views(self.inputs, StepLayout(size, 0, 1), meta_host)
        self._capture(size, step, warm=False, where=" in the background")
