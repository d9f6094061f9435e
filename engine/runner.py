"""The model runner: owns the weights and the KV cache tensor, turns a scheduled step into tensors, runs the model
and samples. The only engine module that touches the device.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, kv_cache_shape
from engine.config import EngineArgs, ModelConfig
from engine.models import load_model
from engine.outputs import PositionLogprobs
from engine.sampling import Sampler, SamplingRow, prompt_logprobs
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

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
        self.model = load_model(args.model, model_config, dtype, device)
        self.load_seconds = time.perf_counter() - t0
        self.num_blocks = args.num_kv_blocks or self._size_kv_cache()
        shape = kv_cache_shape(
            model_config.num_layers, self.num_blocks, self.block_size, model_config.num_kv_heads,
            model_config.head_dim,
        )
        self.kv_cache = torch.empty(shape, dtype=dtype, device=device)
        self.sampler = Sampler()

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
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.args.max_num_batched_tokens, self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        m = self.model_config
        scratch = torch.empty(
            kv_cache_shape(m.num_layers, blocks, self.block_size, m.num_kv_heads, m.head_dim),
            dtype=self.dtype, device=self.device,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        meta = self._metadata([list(range(blocks))], [0], [num_tokens], pos)
        with torch.inference_mode():
            hidden = self.model(ids, pos, scratch, meta)
            self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden
        torch.cuda.empty_cache()  # the profiled step's cached blocks would otherwise sit beside the KV cache
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.args.gpu_memory_utilization - used_by_others - peak
        return int(budget // self.bytes_per_block)

    # ---- one step ------------------------------------------------------------------------------------------
    def _metadata(
        self, block_tables: list[list[int]], starts: list[int], lens: list[int], positions: torch.Tensor
    ) -> AttentionMetadata:
        bs = self.block_size
        dev = self.device
        width = max(len(t) for t in block_tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        seq_lens = [s + n for s, n in zip(starts, lens)]
        # slot of token at position p of sequence i: table[i, p // bs] * bs + p % bs
        seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        pos_cpu = positions.cpu()
        slots = table[seq_of_token, pos_cpu // bs].long() * bs + pos_cpu % bs
        return AttentionMetadata(
            slot_mapping=slots.to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev),
            max_query_len=max(lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )

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

        pos = torch.tensor(positions, dtype=torch.long)
        meta = self._metadata(
            [s.seq.block_table for s in scheduled],
            [s.seq.num_computed_tokens for s in scheduled],
            [s.num_new_tokens for s in scheduled],
            pos,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos.to(self.device), self.kv_cache, meta)
        result = StepResult(sampled={}, prompt_logprobs={})
        if not logit_rows:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=self.device)])

        for seq, row, count, first in prompt_spans:
            targets = seq.token_ids[first + 1 : first + 1 + count]
            result.prompt_logprobs[seq.seq_id] = prompt_logprobs(
                logits[row : row + count], targets, seq.params.prompt_logprobs
            )
        if sample_at:
            order = list(sample_at)
            sampled = self.sampler(logits[[sample_at[i] for i in order]], [rows[i] for i in order])
            for seq_id, tok, lp in zip(order, sampled.token_ids, sampled.logprobs):
                result.sampled[seq_id] = SampledToken(tok, lp)
        return result
