"""The model runner: owns the weights and the KV cache tensor, turns a scheduled step into tensors,
runs the model (on a GPU from CUDA graphs: whole decode steps, and prompt steps cut at attention)
and samples. The only engine module that touches the device.

Under tensor parallelism every rank has a runner over its shard: rank 0's plans each step and
broadcasts the plan, the others run the same plans (engine/distributed/follower.py); only rank 0
samples.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.attention import kv_cache_shape
from engine.attention.kv_quant import check_kv_cache_device, resolve_kv_cache_dtype
from engine.config import EngineArgs, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.distributed.plan import CAPTURE, STEP, STOP, StepPlan
from engine.distributed.sharding import SINGLE
from engine.memory_budget import FIXED_SLACK_BYTES, FRAGMENTATION, step_peak_bytes
from engine.models import load_model
from engine.outputs import PositionLogprobs
from engine.piecewise_graphs import PiecewiseGraphs, reserve_bytes, token_buckets
from engine.sampling import DeviceSample, Sampler, SamplerOutput, SamplingRow, prompt_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.step_inputs import InputStager, PendingIds
from engine.token_bitmask import BitmaskStaging

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        tp=None,
    ):
        """tp: an engine.distributed.comm.TensorParallel (this rank's shard, its collectives, the
        plan channel)."""
        self.args = args
        self.max_model_len = max_model_len
        self.model_config = model_config
        self.tp = tp
        self.shard = tp.shard if tp is not None else SINGLE
        # This rank's heads, KV heads and MLP columns.
        self.local_config = self.shard.local_config(model_config)
        self.dtype = dtype
        self.device = device
        self.block_size = args.block_size
        # the KV cache's dtype: the model's or FP8 (kv_cache_dtype), checked before the weights load
        self.kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
        check_kv_cache_device(self.kv_dtype, device)
        t0 = time.perf_counter()
        self.model = load_model(
            args.model,
            model_config,
            dtype,
            device,
            pack_dir=args.pack_dir,
            load_format=args.load_format,
            shard=self.shard,
            quantization=args.quantization,
            comm=tp.comm if tp is not None else None,
        )
        self.load_seconds = time.perf_counter() - t0
        self.stager = InputStager(device, self.block_size)
        self.sampler = Sampler()
        # structured outputs: the grammar rows' bitmask (made by the first step with a grammar)
        self._bitmask: BitmaskStaging | None = None
        self.use_graphs = self._use_cuda_graphs()
        # prompt and mixed steps from graphs cut at attention: one GPU, dense layers
        self.piecewise_buckets = (
            token_buckets(args.max_num_batched_tokens)
            if self.use_graphs and tp is None and model_config.moe is None
            else []
        )
        self.kv_step_bytes: int | None = None  # the step allowance the KV sizing used (GPU)
        self.num_blocks = args.num_kv_blocks or self._size_kv_cache()
        if tp is not None:  # one scheduler for all ranks: each holds as many blocks as the tightest
            self.num_blocks = tp.comm.min_int(self.num_blocks)
        shape = kv_cache_shape(
            model_config.num_layers,
            self.num_blocks,
            self.block_size,
            self.local_config.num_kv_heads,
            model_config.head_dim,
        )
        self.kv_cache = torch.empty(shape, dtype=self.kv_dtype, device=device)
        log.info(
            "KV cache: %d tokens (%d blocks of %d) in %s, %.2f GiB in one allocation",
            self.num_blocks * self.block_size,
            self.num_blocks,
            self.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            self.num_blocks * self.bytes_per_block / (1 << 30),
        )
        self.graphs: DecodeGraphs | None = None
        if self.use_graphs:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                self.stager,
                args.graph_sizes(),
                max_model_len,
                self.block_size,
                model_config.vocab_size,
                "thread_local" if tp is not None else "global",
            )
            if args.cuda_graph_capture == "start":
                # "lazy": each size is captured by its first decode step
                self.graphs.capture()
        self.pieces: PiecewiseGraphs | None = None
        if self.piecewise_buckets:
            self.pieces = PiecewiseGraphs(
                self.model,
                self._attention_backend(),
                self.kv_cache,
                self.stager,
                self.local_config,
                self.piecewise_buckets,
                args.max_num_seqs,
                self.graphs.table_width,
            )
            if args.cuda_graph_capture == "start":
                # "lazy": a bucket's first step runs eagerly, its second captures it
                self.pieces.capture()

    def _use_cuda_graphs(self) -> bool:
        """Graphs need a GPU, enforce_eager off, and an attention backend whose decode launch is
        graph-safe."""
        if self.device.type != "cuda" or self.args.enforce_eager:
            return False
        backend = self._attention_backend()
        safe = getattr(backend, "supports_cuda_graphs", False)
        if not safe:
            log.info(
                "CUDA graphs off: attention backend %r has no graph-safe decode",
                getattr(backend, "name", None),
            )
        return bool(safe)

    def _attention_backend(self):
        """The attention backend the model's layers share (None for a model without layers)."""
        return self.model.layers[0].self_attn.backend if len(self.model.layers) else None

    # ---- KV sizing
    # -----------------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        m = self.local_config
        return (
            2
            * m.num_layers
            * self.block_size
            * m.num_kv_heads
            * m.head_dim
            * self.kv_dtype.itemsize
        )

    def _size_kv_cache(self) -> int:
        """CPU: a fixed byte budget. GPU: what gpu_memory_utilization leaves after what this process
        holds (the weights), the largest step's activations (kv_sizing "analytic": an upper bound
        from the model's shapes; "profile": the peak of that step, run once), the CUDA graphs and
        whatever other processes hold."""
        if self.device.type != "cuda":
            blocks = self.args.cpu_kv_cache_bytes // self.bytes_per_block
        else:
            m = self.model_config
            num_tokens = min(self.args.max_num_batched_tokens, self.max_model_len)
            num_rows = min(self.args.max_num_seqs, num_tokens)
            torch.cuda.synchronize(self.device)
            # the weights' buffer is allocated even while streaming
            held = torch.cuda.memory_allocated(self.device)
            if self.args.kv_step_bytes is not None:
                # one step's measured peak: fragmentation and slack on top, as the analytic
                # bound has
                step = int(self.args.kv_step_bytes * FRAGMENTATION) + FIXED_SLACK_BYTES
                how = "recorded peak (with margins) of a"
            elif self.args.kv_sizing == "profile":
                step = self._profile_gpu_blocks(num_tokens, num_rows) - held
                how = "peak of a profiled"
            else:
                step = step_peak_bytes(
                    self.local_config,
                    self.dtype.itemsize,
                    num_tokens,
                    num_rows,
                    getattr(self._attention_backend(), "name", "triton"),
                )
                how = "bound of a"
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free - torch.cuda.memory_reserved(self.device)
            # The decode graphs (captured after the KV cache, at start or lazily) keep a static fp32
            # logits buffer (and a bf16 one in their pool) for the largest batch; their other
            # activations are small next to it.
            graphs = (
                self.args.graph_sizes()[-1] * m.vocab_size * 6 + (64 << 20)
                if self.use_graphs
                else 0
            )
            if self.piecewise_buckets:  # the prompt steps' graph pool and static buffers
                graphs += reserve_bytes(
                    self.local_config, self.dtype.itemsize, self.piecewise_buckets[-1]
                )
            budget = (
                total * self.args.gpu_memory_utilization - used_by_others - held - step - graphs
            )
            log.info(
                "KV sizing: %.2f GiB total, %.2f GiB held (weights), %.2f GiB %s %d-token step, "
                "%.2f GiB held by "
                "others, %.2f GiB kept for CUDA graphs, %.2f GiB left for the KV cache at "
                "gpu_memory_utilization=%.2f",
                total / (1 << 30),
                held / (1 << 30),
                step / (1 << 30),
                how,
                num_tokens,
                used_by_others / (1 << 30),
                graphs / (1 << 30),
                budget / (1 << 30),
                self.args.gpu_memory_utilization,
            )
            self.kv_step_bytes = step  # what a compiled engine's build records
            blocks = budget // self.bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache: one block needs {self.bytes_per_block} bytes "
                f"(raise gpu_memory_utilization / cpu_kv_cache_bytes, or set num_kv_blocks)"
            )
        return int(blocks)

    def _profile_gpu_blocks(self, num_tokens: int, num_rows: int) -> int:
        """Run the largest step the scheduler can make (one num_tokens prefill through the selected
        attention backend) and a sampler pass over num_rows rows with top-p; returns the peak bytes
        allocated meanwhile (what was allocated before included). Also loads the step's Triton
        kernels."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks = -(-num_tokens // self.block_size)
        m = self.local_config
        scratch = torch.empty(
            kv_cache_shape(m.num_layers, blocks, self.block_size, m.num_kv_heads, m.head_dim),
            dtype=self.kv_dtype,
            device=self.device,
        )
        step = self.stager.stage(
            [0] * num_tokens, range(num_tokens), [0], [num_tokens], [list(range(blocks))]
        )
        with torch.inference_mode():
            hidden = self.model(step.input_ids, step.positions, scratch, step.meta)
            logits = self.model.compute_logits(hidden[-num_rows:])
            del hidden
            params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
            self.sampler(logits, [SamplingRow(params, None, [], [], []) for _ in range(num_rows)])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        # The scratch KV cache is not part of a real step's activations: it stands in for the KV
        # cache.
        peak -= scratch.numel() * scratch.element_size()
        del scratch, logits, step
        # the profiled step's cached blocks would otherwise sit beside the KV cache
        torch.cuda.empty_cache()
        return peak

    # ---- one step
    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[ScheduledSeq],
        rows: dict[int, SamplingRow],
        previous: LaunchedStep | None = None,
        fill_masks: Callable[[torch.Tensor, list], bool] | None = None,
    ) -> LaunchedStep:
        """Queue one step on the device (inputs, model, sampling, the copy of the sampled ids to the
        host) and return without waiting for it; LaunchedStep.result() waits. rows holds a
        SamplingRow for each sequence that samples this step, by seq_id. A sequence's last token may
        still be pending (sampled by `previous`, whose result is not read yet): its id is taken from
        previous's tokens on the device.

        Rows with a grammar: once the model is queued, fill_masks(host_bitmask, matchers) brings
        the matchers up to date (it may read `previous`, whose tokens the device has by then) and
        fills the rows on the host while the device runs the model; the sampler masks the logits
        with the bitmask's copy on the device."""
        scheduled = _decodes_first(scheduled)
        plan, sampled_seqs, sample_at, prompt_spans = self._plan(scheduled, previous)
        if self.tp is not None:
            self.tp.channel.send(STEP, plan.encode())
        logits = self._forward(plan, previous.sample.token_ids if plan.fill_dst else None)
        result = LaunchedStep(sampled_seqs, None, {})
        if logits is None:
            return result
        for seq, row, count, first in prompt_spans:
            targets = seq.token_ids[first + 1 : first + 1 + count]
            result.prompt_logprobs[seq.seq_id] = prompt_logprobs(
                logits[row : row + count], targets, seq.params.prompt_logprobs
            )
        if sampled_seqs:
            if len(sample_at) == logits.shape[0]:
                # every logits row samples (no prompt-logprob rows)
                sample_logits = logits
            else:
                sample_logits = logits[sample_at]
            sample_rows = [rows[seq.seq_id] for seq in sampled_seqs]
            bitmask = self._grammar_bitmask(sample_rows, fill_masks)
            # the logits are this step's own (the graph's output is rewritten by the next replay)
            result.sample = self.sampler.sample(sample_logits, sample_rows, bitmask, scratch=True)
            if bitmask is not None:
                self._bitmask.used()
            result.sample.start_copy()
        return result

    def _grammar_bitmask(self, rows: list[SamplingRow], fill_masks) -> torch.Tensor | None:
        """The bitmask of this step's grammar rows on the device, or None when no row has a grammar
        (or none constrains its token yet)."""
        matchers = [r.grammar for r in rows]
        if fill_masks is None or all(m is None for m in matchers):
            return None
        if self._bitmask is None:
            self._bitmask = BitmaskStaging(
                self.model_config.vocab_size, self.device, self.args.max_num_seqs
            )
        if not fill_masks(self._bitmask.host_rows(len(rows)), matchers):
            return None
        return self._bitmask.to_device(len(rows))

    def _plan(self, scheduled: list[ScheduledSeq], previous: LaunchedStep | None):
        """The step's plan (what every rank runs), and what only rank 0 needs: the sequences that
        sample, their rows among the logits, and the prompt-logprob spans (seq, first logit row,
        count, first position)."""
        ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        logit_rows: list[int] = []  # rows of the hidden states that need logits
        sampled_seqs: list[Sequence] = []  # in logit-row order after any prompt rows
        sample_at: list[int] = []  # index into logit_rows of each sampled sequence
        prompt_spans: list[tuple[Sequence, int, int, int]] = []
        fill_dst: list[int] = []  # input rows whose token is pending on the device ...
        fill_src: list[int] = []  # ... and its row in previous's sampled tokens
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            token_ids = seq.token_ids
            base = len(ids)
            starts.append(start)
            tables.append(seq.block_table)
            missing = start + n - len(token_ids)  # tokens of this chunk not known on the host
            if missing > 0:
                if missing > 1 or previous is None or seq.seq_id not in previous.row_of:
                    raise RuntimeError(
                        f"sequence {seq.seq_id}: {missing} token(s) of its step are not known"
                    )
                fill_dst.append(base + n - 1)
                fill_src.append(previous.row_of[seq.seq_id])
            if n == 1:
                ids.append(token_ids[start] if missing <= 0 else 0)
                positions.append(start)
            else:
                ids.extend(token_ids[start : start + n])
                if missing > 0:
                    ids.append(0)
                positions.extend(range(start, start + n))
            if seq.index == 0 and seq.request.params.prompt_logprobs is not None:
                # logits at position p give the logprob of prompt token p + 1
                first = max(start, len(seq.request.prompt_logprobs) - 1)
                last = min(start + n, seq.num_prompt_tokens - 1)
                if last > first:
                    prompt_spans.append((seq, len(logit_rows), last - first, first))
                    logit_rows.extend(range(base + first - start, base + last - start))
            if start + n == len(token_ids) + seq.num_pending:
                # s.completes: this step samples its next token
                sampled_seqs.append(seq)
                sample_at.append(len(logit_rows))
                logit_rows.append(base + n - 1)
        lens = [s.num_new_tokens for s in scheduled]
        plan = StepPlan(
            ids,
            starts,
            lens,
            tables,
            logit_rows,
            fill_dst,
            fill_src,
            len(previous.seqs) if fill_dst else 0,
            positions,
        )
        return plan, sampled_seqs, sample_at, prompt_spans

    def _forward(self, plan: StepPlan, previous_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Run one planned step on this rank: the logits [rows, vocab] of plan.logit_rows (None when
        no row needs them). previous_ids: the ids the previous step sampled, on rank 0 (the others
        receive them here)."""
        pending = None
        if plan.fill_dst:
            tokens = previous_ids
            if self.tp is not None:
                if tokens is None:
                    tokens = torch.empty(plan.prev_rows, dtype=torch.int64, device=self.device)
                self.tp.comm.broadcast(tokens)
            pending = PendingIds(plan.fill_dst, plan.fill_src, tokens)

        ids, positions, starts, tables = plan.ids, plan.positions, plan.starts, plan.tables
        logit_rows = plan.logit_rows
        num_rows = len(ids)
        all_rows = len(logit_rows) == num_rows and (
            not logit_rows or logit_rows[-1] == num_rows - 1
        )
        if self.graphs is not None and num_rows == len(starts) and num_rows <= self.graphs.max_size:
            # Pure decode: the graph computes every row's logits; pick the ones this step needs.
            all_logits = self.graphs.run(ids, positions, starts, tables, pending=pending)
            if not logit_rows:
                return None
            if all_rows:
                return all_logits
            return _take_rows(all_logits, logit_rows)
        if self.pieces is not None and num_rows <= self.pieces.max_tokens:
            hidden = self.pieces.run(ids, positions, starts, plan.lens, tables, pending)
        else:
            step = self.stager.stage(ids, positions, starts, plan.lens, tables, pending=pending)
            hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
        if not logit_rows:
            return None
        if not all_rows:
            hidden = _take_rows(hidden, logit_rows)
        return self.model.compute_logits(hidden)

    # ---- the other ranks' side (and what rank 0 tells them) ----------------------------------
    def follow(self) -> None:
        """A rank other than 0: run rank 0's commands until it says stop (or the channel fails)."""
        channel = self.tp.channel
        while True:
            kind, body = channel.recv()
            if kind == STEP:
                with torch.inference_mode():
                    self._forward(StepPlan.decode(body), None)
            elif kind == CAPTURE:
                self.capture_graphs(body.tolist() or None)
            elif kind == STOP:
                return
            else:
                raise RuntimeError(f"tensor parallel: unknown command {kind} from rank 0")

    def capture_graphs(self, sizes: list[int] | None = None) -> None:
        """Capture the decode graphs of `sizes` (default: every size) not captured yet, on every
        rank."""
        if self.graphs is None:
            return
        if self.tp is not None and self.shard.rank == 0:
            self.tp.channel.send(CAPTURE, np.asarray(sizes or [], dtype=np.int64))
        self.graphs.capture(sizes)

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop (they exit once they have)."""
        if self.tp is not None and self.shard.rank == 0:
            self.tp.channel.send(STOP)


def _take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows `rows` of x: a view where they follow one another (a lone prompt's last token),
    which leaves the host free to queue the logits and the sampler behind the step's work; else a
    gather, whose index copied from pageable memory first waits for the stream."""
    first = rows[0]
    if all(row == first + i for i, row in enumerate(rows)):
        return x[first : first + len(rows)]
    return x[torch.tensor(rows).to(x.device, non_blocking=True)]


def _decodes_first(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The step's one-token sequences before its prompt chunks, each group in its order: attention
    runs the leading ones with its decode tiles (AttentionMetadata.num_decode_seqs)."""
    if all(s.num_new_tokens == 1 for s in scheduled):
        return scheduled
    return sorted(scheduled, key=lambda s: s.num_new_tokens != 1)


class LaunchedStep:
    """A step queued on the device. seqs: the sequences it samples a token for, in row order;
    sample: their tokens still on the device (None when none samples); prompt_logprobs: seq_id ->
    the logprobs of the prompt tokens it computed (read back already)."""

    def __init__(
        self,
        seqs: list[Sequence],
        sample: DeviceSample | None,
        prompt_logprobs: dict[int, list[PositionLogprobs]],
    ):
        self.seqs = seqs
        self.sample = sample
        self.prompt_logprobs = prompt_logprobs
        self.needs_host_tokens = (
            False  # set by the core: a row has penalties, so the next step waits for these ids
        )

    @functools.cached_property
    def row_of(self) -> dict[int, int]:
        """seq_id -> its row in the sampled tokens."""
        return {seq.seq_id: i for i, seq in enumerate(self.seqs)}

    def result(self) -> SamplerOutput:
        """The sampled tokens (and logprobs) on the host, in the order of seqs: waits for their copy
        only."""
        if self.sample is None:
            return SamplerOutput([], [])
        return self.sample.result()
