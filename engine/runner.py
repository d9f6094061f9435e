"""The model runner: owns the weights and the KV cache tensor, turns a scheduled step into tensors, runs the model
(decode steps from CUDA graphs on a GPU) and samples. The only engine module that touches the device.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import kv_cache_shape
from engine.config import EngineArgs, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.models import load_model
from engine.outputs import PositionLogprobs
from engine.sampling import Sampler, SamplingParams, SamplingRow, prompt_logprobs
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.step_inputs import InputStager

log = logging.getLogger(__name__)


@dataclass
class SampledToken:
    token_id: int
    logprobs: PositionLogprobs | None


@dataclass
class StepResult:
    sampled: dict[int, SampledToken]  # seq_id -> the token sampled for it this step
    prompt_logprobs: dict[int, list[PositionLogprobs]]  # seq_id -> logprobs of prompt tokens computed this step


class ModelRunner:
    def __init__(
        self, args: EngineArgs, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
        max_model_len: int,
    ):
        self.args = args
        self.max_model_len = max_model_len
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        self.block_size = args.block_size
        t0 = time.perf_counter()
        self.model = load_model(args.model, model_config, dtype, device, pack_dir=args.pack_dir,
                                load_format=args.load_format)
        self.load_seconds = time.perf_counter() - t0
        self.stager = InputStager(device, self.block_size)
        self.sampler = Sampler()
        self.use_graphs = self._use_cuda_graphs()
        self.num_blocks = args.num_kv_blocks or self._size_kv_cache()
        shape = kv_cache_shape(
            model_config.num_layers, self.num_blocks, self.block_size, model_config.num_kv_heads,
            model_config.head_dim,
        )
        self.kv_cache = torch.empty(shape, dtype=dtype, device=device)
        log.info("KV cache: %d blocks of %d tokens, %.2f GiB in one allocation", self.num_blocks, self.block_size,
                 self.num_blocks * self.bytes_per_block / (1 << 30))
        self.graphs: DecodeGraphs | None = None
        if self.use_graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kv_cache, self.stager, args.graph_sizes(), max_model_len, self.block_size,
                model_config.vocab_size,
            )
            self.graphs.capture()

    def _use_cuda_graphs(self) -> bool:
        """Graphs need a GPU, enforce_eager off, and an attention backend whose decode launch is graph-safe."""
        if self.device.type != "cuda" or self.args.enforce_eager:
            return False
        backend = self.model.layers[0].self_attn.backend if len(self.model.layers) else None
        safe = getattr(backend, "supports_cuda_graphs", False)
        if not safe:
            log.info("CUDA graphs off: attention backend %r has no graph-safe decode", getattr(backend, "name", None))
        return bool(safe)

    # ---- KV sizing -----------------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        m = self.model_config
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def _size_kv_cache(self) -> int:
        """CPU: a fixed byte budget. GPU: what gpu_memory_utilization leaves after weights and a profiled step."""
        if self.device.type != "cuda":
            blocks = self.args.cpu_kv_cache_bytes // self.bytes_per_block
        else:
            blocks = self._profile_gpu_blocks()
        if blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache: one block needs {self.bytes_per_block} bytes "
                f"(raise gpu_memory_utilization / cpu_kv_cache_bytes, or set num_kv_blocks)"
            )
        return int(blocks)

    def _profile_gpu_blocks(self) -> int:
        """Run the largest step the scheduler can make (one max_num_batched_tokens prefill through the selected
        attention backend) and a sampler pass over max_num_seqs rows with top-p; the KV cache gets what is left
        of gpu_memory_utilization after that peak and whatever other processes hold."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.args.max_num_batched_tokens, self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        m = self.model_config
        scratch = torch.empty(
            kv_cache_shape(m.num_layers, blocks, self.block_size, m.num_kv_heads, m.head_dim),
            dtype=self.dtype, device=self.device,
        )
        step = self.stager.stage(
            [0] * num_tokens, range(num_tokens), [0], [num_tokens], [list(range(blocks))]
        )
        num_rows = min(self.args.max_num_seqs, num_tokens)
        with torch.inference_mode():
            hidden = self.model(step.input_ids, step.positions, scratch, step.meta)
            logits = self.model.compute_logits(hidden[-num_rows:])
            del hidden
            params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
            self.sampler(logits, [SamplingRow(params, None, [], [], []) for _ in range(num_rows)])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, logits, step
        torch.cuda.empty_cache()  # the profiled step's cached blocks would otherwise sit beside the KV cache
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        # The decode graphs, captured after the KV cache, keep a static fp32 logits buffer (and a bf16 one in
        # their pool) for the largest batch; their other activations are small next to it.
        graphs = self.args.graph_sizes()[-1] * m.vocab_size * 6 + (64 << 20) if self.use_graphs else 0
        budget = total * self.args.gpu_memory_utilization - used_by_others - peak - graphs
        log.info(
            "KV sizing: %.2f GiB total, %.2f GiB peak in a profiled %d-token step (weights included), %.2f GiB "
            "held by others, %.2f GiB kept for CUDA graphs, %.2f GiB left for the KV cache at "
            "gpu_memory_utilization=%.2f", total / (1 << 30), peak / (1 << 30), num_tokens,
            used_by_others / (1 << 30), graphs / (1 << 30), budget / (1 << 30), self.args.gpu_memory_utilization,
        )
        return int(budget // self.bytes_per_block)

    # ---- one step ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], rows: dict[int, SamplingRow]) -> StepResult:
        """Run one step. rows holds a SamplingRow for each sequence that samples this step, by seq_id."""
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []  # rows of the hidden states that need logits
        sample_at: dict[int, int] = {}  # seq_id -> index into logit_rows
        prompt_spans: list[tuple[Sequence, int, int, int]] = []  # (seq, first logit row, count, first position)
        for s in scheduled:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            base = len(ids)
            if n == 1:
                ids.append(seq.token_ids[start])
                positions.append(start)
            else:
                ids.extend(seq.token_ids[start : start + n])
                positions.extend(range(start, start + n))
            if seq.wants_prompt_logprobs:
                # logits at position p give the logprob of prompt token p + 1
                first = max(start, len(seq.request.prompt_logprobs) - 1)
                last = min(start + n, seq.num_prompt_tokens - 1)
                if last > first:
                    prompt_spans.append((seq, len(logit_rows), last - first, first))
                    logit_rows.extend(range(base + first - start, base + last - start))
            if s.completes:
                sample_at[seq.seq_id] = len(logit_rows)
                logit_rows.append(base + n - 1)

        result = StepResult(sampled={}, prompt_logprobs={})
        starts = [s.seq.num_computed_tokens for s in scheduled]
        tables = [s.seq.block_table for s in scheduled]
        one_token_each = len(ids) == len(scheduled)
        if self.graphs is not None and one_token_each and len(ids) <= self.graphs.max_size:
            # Pure decode: the graph computes every row's logits; pick the ones this step needs.
            all_logits = self.graphs.run(ids, positions, starts, tables)
            if not logit_rows:
                return result
            if logit_rows == list(range(len(ids))):
                logits = all_logits
            else:
                logits = all_logits[torch.tensor(logit_rows).to(self.device, non_blocking=True)]
        else:
            step = self.stager.stage(ids, positions, starts, [s.num_new_tokens for s in scheduled], tables)
            hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
            if not logit_rows:
                return result
            if logit_rows != list(range(hidden.shape[0])):
                hidden = hidden[torch.tensor(logit_rows).to(self.device, non_blocking=True)]
            logits = self.model.compute_logits(hidden)

        for seq, row, count, first in prompt_spans:
            targets = seq.token_ids[first + 1 : first + 1 + count]
            result.prompt_logprobs[seq.seq_id] = prompt_logprobs(
                logits[row : row + count], targets, seq.params.prompt_logprobs
            )
        if sample_at:
            order = list(sample_at)
            picks = [sample_at[i] for i in order]
            sample_logits = logits if picks == list(range(logits.shape[0])) else logits[picks]
            sampled = self.sampler(sample_logits, [rows[i] for i in order])
            for seq_id, tok, lp in zip(order, sampled.token_ids, sampled.logprobs):
                result.sampled[seq_id] = SampledToken(tok, lp)
        return result
