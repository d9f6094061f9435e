"""Drive the engine's AsyncLLM as clients do: all requests at once (offline), N looping clients
(online), one request alone (decode), while a poller samples the engine's stats; every streamed
output is timestamped on arrival.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing
from dataclasses import asdict

from bench.timing import RequestRecord
from bench.trace import BenchRequest, random_prompt
from engine import AsyncLLM, SamplingParams


def forced_params(output_len: int) -> SamplingParams:
    """Greedy, exactly output_len tokens: EOS ignored and held back, no stop rules."""
    return SamplingParams(
        temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True
    )


async def stream_request(
    engine: AsyncLLM,
    request_id: str,
    req: BenchRequest,
    rec: RequestRecord,
    stop_at: float | None = None,
) -> RequestRecord:
    """Stream one request into rec. Past stop_at (if given) it is aborted as soon as it has its
    first token."""
    async with aclosing(
        engine.generate(request_id, req.prompt_token_ids, forced_params(req.output_len))
    ) as stream:
        async for out in stream:
            rec.add(time.perf_counter(), len(out.outputs[0].token_ids))
            if out.finished:
                rec.finish_reason = out.outputs[0].finish_reason
            elif stop_at is not None and rec.chunks and time.perf_counter() > stop_at:
                break  # leaving the stream aborts the request and frees its blocks
    return rec


class StatsPoller:
    """Samples engine.stats() every interval seconds (between engine steps) while the block runs."""

    def __init__(self, engine: AsyncLLM, interval: float = 0.1):
        self.engine = engine
        self.interval = interval
        self.samples: list[tuple[float, dict]] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            stats = await asyncio.to_thread(self.engine.stats)
            self.samples.append((time.perf_counter(), asdict(stats)))
            await asyncio.sleep(self.interval)

    async def __aenter__(self) -> "StatsPoller":
        self.samples.append(
            (time.perf_counter(), asdict(await asyncio.to_thread(self.engine.stats)))
        )
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self.samples.append(
            (time.perf_counter(), asdict(await asyncio.to_thread(self.engine.stats)))
        )

    def first_preemption_time(self) -> float | None:
        """The last sample time before the engine's preemption count first rose (None: no
        preemption)."""
        base = self.samples[0][1]["num_preemptions"]
        for (t_prev, _), (_, s) in zip(self.samples, self.samples[1:]):
            if s["num_preemptions"] > base:
                return t_prev
        return None

    def kv(self) -> dict:
        """Blocks allocated vs the most in use at any sample, and the engine's own lifetime peak."""
        first, last = self.samples[0][1], self.samples[-1][1]
        total = last["num_kv_blocks"]
        sampled_peak = max(s["num_kv_blocks"] - s["num_free_blocks"] for _, s in self.samples)
        return {
            "num_kv_blocks": total,
            "peak_used_blocks_sampled": sampled_peak,
            "engine_peak_used_blocks": last["peak_used_blocks"],
            "waste_frac_sampled": 1 - sampled_peak / total,
            "preemptions": last["num_preemptions"] - first["num_preemptions"],
            "prefix_cache_hit_tokens": last["prefix_cache_hit_tokens"]
            - first["prefix_cache_hit_tokens"],
        }


async def wait_idle(engine: AsyncLLM, timeout: float = 60.0) -> None:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        s = await asyncio.to_thread(engine.stats)
        if s.num_running == 0 and s.num_waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("engine still busy after the workload ended")


async def run_offline(engine: AsyncLLM, requests: list[BenchRequest], tag: str):
    """Submit every request at once; returns (records, wall start, wall end, poller)."""
    async with StatsPoller(engine) as poller:
        start = time.perf_counter()
        records = [RequestRecord(r.prompt_len, r.output_len, start) for r in requests]
        await asyncio.gather(
            *(
                stream_request(engine, f"{tag}-{i}", r, rec)
                for i, (r, rec) in enumerate(zip(requests, records))
            )
        )
        end = max((r.last_token_time for r in records if r.chunks), default=start)
    await wait_idle(engine)
    return records, start, end, poller


async def run_online(
    engine: AsyncLLM,
    make_request: Callable[[int], BenchRequest],
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    tag: str,
    counter: Iterator[int],
):
    """`concurrency` clients, each sending its next request when the last one ends, for
    warmup_s + duration_s. Request k is make_request(k) for k from counter (share one across
    levels, so no prompt repeats and hits the prefix cache). Requests still open at the end are
    aborted once they have their first token (so no TTFT is cut off). Returns (records, window
    start, window end, poller): the window excludes the warm-up."""
    records: list[RequestRecord] = []
    async with StatsPoller(engine) as poller:
        start = time.perf_counter()
        window = (start + warmup_s, start + warmup_s + duration_s)

        async def client() -> None:
            while time.perf_counter() < window[1]:
                k = next(counter)
                req = make_request(k)
                rec = RequestRecord(req.prompt_len, req.output_len, time.perf_counter())
                records.append(rec)
                await stream_request(engine, f"{tag}-{k}", req, rec, stop_at=window[1])

        await asyncio.gather(*(client() for _ in range(concurrency)))
    await wait_idle(engine)
    return records, window[0], window[1], poller


async def decode_step_times(
    engine: AsyncLLM, prompt_len: int, new_tokens: int, vocab: int, repeats: int, seed: int
):
    """Seconds per decode step of one request alone, from the engine's own first-token and finish
    times."""
    times = []
    for i in range(repeats):
        req = BenchRequest(random_prompt(prompt_len, vocab, seed + i), new_tokens)
        final = None
        async with aclosing(
            engine.generate(f"decode-{seed}-{i}", req.prompt_token_ids, forced_params(new_tokens))
        ) as s:
            async for out in s:
                final = out
        m = final.metrics
        if len(final.outputs[0].token_ids) != new_tokens:
            raise RuntimeError(
                f"decode: got {len(final.outputs[0].token_ids)} tokens, asked for {new_tokens}"
            )
        times.append((m.finished_time - m.first_token_time) / (new_tokens - 1))
    return statistics.median(times), times
