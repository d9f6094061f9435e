"""The HF transformers baseline on the same requests: `generate` in static padded batches, and its
continuous batching manager (what `generate_batch` runs) with per-request output lengths; token
timestamps for both.
"""

from __future__ import annotations

import gc
import time

import torch

from bench.timing import RequestRecord
from bench.trace import BenchRequest


def load_hf_model(model_dir: str, dtype: torch.dtype, device: str):
    # slow to import: only the hf part pays for it
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device)
    model.eval()
    return model


def free_hf_model(model) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _step_timer():
    """A generate() streamer that timestamps each decoding step (the first put is the prompt
    itself)."""
    from transformers.generation.streamers import BaseStreamer

    class StepTimer(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value) -> None:
            if self._prompt_seen:
                self.times.append(time.perf_counter())
            self._prompt_seen = True

        def end(self) -> None:
            pass

    return StepTimer()


@torch.inference_mode()
def _generate_padded(model, batch: list[BenchRequest], device: str, timer=None) -> torch.Tensor:
    """One static batch: prompts left-padded to the longest, every row run to the batch's longest
    output."""
    width = max(r.prompt_len for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - r.prompt_len :] = 1
    new = max(r.output_len for r in batch)
    return model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        streamer=timer,
    )


def run_generate(model, requests: list[BenchRequest], batch_size: int, device: str):
    """Static batches in trace order; a request's token j is the batch's step j. Returns (records,
    start, end)."""
    _generate_padded(model, [BenchRequest(requests[0].prompt_token_ids[:16], 4)], device)  # warm-up
    _sync(device)
    start = time.perf_counter()
    records = []
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        timer = _step_timer()
        _generate_padded(model, batch, device, timer)
        for r in batch:
            rec = RequestRecord(r.prompt_len, r.output_len, start)
            for j in range(min(r.output_len, len(timer.times))):
                rec.add(timer.times[j], j + 1)
            rec.finish_reason = "length"
            records.append(rec)
    _sync(device)
    return records, start, time.perf_counter()


def decode_step_time(model, req: BenchRequest, device: str) -> float:
    """Seconds per decode step of generate at batch 1."""
    _generate_padded(model, [BenchRequest(req.prompt_token_ids, 4)], device)  # warm-up
    timer = _step_timer()
    _generate_padded(model, [req], device, timer)
    return (timer.times[-1] - timer.times[0]) / (len(timer.times) - 1)


def run_continuous_batching(model, requests: list[BenchRequest], device: str):
    """All requests into HF's continuous batching manager at once, each with its own max_new_tokens
    and EOS off. The manager's set-up (cache allocation, CUDA-graph warm-up) is left out of the
    timing. Returns (records, start, end)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=max(r.output_len for r in requests), do_sample=False)
    on_gpu = device.startswith("cuda")
    # What generate left cached goes back, so the manager sizes its cache from all free memory.
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    # On a GPU HF sizes its paged cache from free memory; on CPU that would zero gigabytes, so give
    # it what it needs.
    longest = max(r.prompt_len + r.output_len for r in requests)
    cb_config = (
        None
        if on_gpu
        else ContinuousBatchingConfig(num_blocks=len(requests) * (longest // 16 + 1) + 8)
    )
    with model.continuous_batching_context_manager(
        generation_config=config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=60,
        warmup=on_gpu,
    ) as manager:
        start = time.perf_counter()
        ids = [
            manager.add_request(
                r.prompt_token_ids,
                max_new_tokens=r.output_len,
                record_timestamps=True,
                eos_token_id=-1,
            )
            for r in requests
        ]
        results = {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError(
                    f"HF continuous batching stopped with {len(ids) - len(results)} requests left"
                )
        end = time.perf_counter()
    records = []
    for rid, r in zip(ids, requests):
        out = results[rid]
        if out.error is not None:
            raise RuntimeError(f"HF continuous batching failed a request: {out.error}")
        rec = RequestRecord(r.prompt_len, r.output_len, start)
        for j, t in enumerate(out.timestamps or []):
            rec.add(t, j + 1)
        rec.finish_reason = "length"
        records.append(rec)
    return records, start, end


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
