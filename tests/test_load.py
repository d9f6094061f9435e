"""Load: 200 streaming requests from 50 concurrent clients (the official async openai client)
against `python -m handler serve` on CPU with SmolLM2; every one completes once, with the engine's
greedy output.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from openai import AsyncOpenAI

from engine import LLM, SamplingParams
from tests.serve_process import ServeProcess

NUM_REQUESTS = 200
CONCURRENCY = 50
MAX_TOKENS = 6
MAX_MODEL_LEN = 256


def _chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {i} plus {i}?"}]


def _prompt(i: int) -> str:
    return f"Item number {i} on the list is"


@pytest.mark.slow
def test_200_streams_from_50_clients_all_complete_exactly(smollm2_dir):
    # The reference: the engine itself, greedy, one call for every prompt.
    llm = LLM(model=smollm2_dir, max_model_len=MAX_MODEL_LEN, device="cpu", num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    chat_ids = [i for i in range(NUM_REQUESTS) if i % 2 == 0]
    text_ids = [i for i in range(NUM_REQUESTS) if i % 2 == 1]
    outs = dict(zip(chat_ids, llm.chat([_chat(i) for i in chat_ids], params)))
    outs.update(zip(text_ids, llm.generate([_prompt(i) for i in text_ids], params)))
    expected = {i: out.outputs[0].text for i, out in outs.items()}
    expected_tokens = sum(len(out.outputs[0].token_ids) for out in outs.values())
    del llm

    server = ServeProcess(
        {
            "MODEL_NAME": smollm2_dir,
            "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "DEVICE": "cpu",
            "LOG_LEVEL": "WARNING",
            "MAX_NUM_SEQS": "64",
        }
    )
    try:
        results = asyncio.run(_run_clients(server.base_url, smollm2_dir))
        metrics = httpx.get(server.base_url + "/metrics").text
    finally:
        server.stop()

    failures = {i: r for i, r in results.items() if isinstance(r, BaseException)}
    assert not failures, {i: repr(e) for i, e in list(failures.items())[:5]}
    assert sorted(results) == list(range(NUM_REQUESTS))  # none lost
    for i, r in results.items():
        assert len(r["ids"]) == 1, i  # every chunk of a stream belongs to that stream's response
    # none duplicated or crossed
    assert len({next(iter(r["ids"])) for r in results.values()}) == NUM_REQUESTS
    for i, r in results.items():
        assert r["finishes"] == 1, i  # exactly one final chunk
        assert r["text"] == expected[i], (i, r["text"], expected[i])
    served = sum(
        int(n)
        for n in re.findall(
            r'^coldbrew_requests_total\{route="[^"]+",status="200"\} (\d+)$', metrics, re.M
        )
    )
    assert served == NUM_REQUESTS
    generated = int(re.search(r"^coldbrew_generation_tokens_total (\d+)$", metrics, re.M).group(1))
    assert generated == expected_tokens


async def _run_clients(base_url: str, model: str) -> dict[int, dict | BaseException]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        client = AsyncOpenAI(
            base_url=base_url + "/v1", api_key="unused", max_retries=0, http_client=http
        )
        gate = asyncio.Semaphore(CONCURRENCY)
        results: dict[int, dict | BaseException] = {}

        async def one(i: int) -> None:
            async with gate:
                try:
                    if i % 2 == 0:
                        stream = await client.chat.completions.create(
                            model=model,
                            messages=_chat(i),
                            temperature=0,
                            max_tokens=MAX_TOKENS,
                            stream=True,
                        )
                    else:
                        stream = await client.completions.create(
                            model=model,
                            prompt=_prompt(i),
                            temperature=0,
                            max_tokens=MAX_TOKENS,
                            stream=True,
                        )
                    results[i] = await _collect(stream)
                except BaseException as exc:  # recorded, so one failure does not hide the others
                    results[i] = exc

        await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
        return results


async def _collect(stream) -> dict:
    """A stream's response ids, text and number of final chunks (chat deltas or completion
    texts)."""
    ids, text, finishes = set(), "", 0
    async for chunk in stream:
        ids.add(chunk.id)
        for c in chunk.choices:
            text += (c.delta.content or "") if hasattr(c, "delta") else c.text
            finishes += c.finish_reason is not None
    return {"ids": ids, "text": text, "finishes": finishes}
