"""engine.output_text: an engine without its tokenizer (skip_tokenizer_init), its outputs given text
by the caller's tokenizer, ends each request as the detokenizing engine does: the same text, token
ids, finish and stop reasons, logprobs with their decoded tokens, cumulative logprob, streamed text
that only grows. The reference is the engine's own detokenizing core, SmolLM2 on CPU (its real
tokenizer, chat template and end-of-turn token), greedy or seeded, through JSON as `serve` sends it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from engine import AsyncLLM, SamplingParams
from engine.output_text import OutputText, engine_params
from engine.wire import OutputAssembly, OutputDeltas


@pytest.fixture(scope="module")
def engines(smollm2_dir):
    common = dict(dtype="float32", device="cpu", max_model_len=512, max_num_batched_tokens=32)
    own = AsyncLLM(model=smollm2_dir, **common)
    bare = AsyncLLM(model=smollm2_dir, skip_tokenizer_init=True, **common)
    assert bare.tokenizer is None
    yield own, bare
    own.shutdown()
    bare.shutdown()


def _plain(out) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(out)))


async def _reference(engine, prompt, params) -> list[dict]:
    return [_plain(out) async for out in engine.generate("own", prompt, params)]


async def _through_output_text(engine, tokenizer, prompt, params) -> list[dict]:
    eos = set(engine.engine.eos_token_ids) | {tokenizer.eos_token_id}
    text, deltas, assembly = OutputText(tokenizer, params, eos), OutputDeltas(), OutputAssembly("r")
    outs = []
    async for out in engine.generate("bare", prompt, engine_params(params)):
        # as `serve` sends them: deltas through JSON, put back together, then given text
        delta = json.loads(json.dumps(deltas.delta(out)))
        mine = text.process(assembly.apply(delta))
        outs.append(_plain(mine))
        if mine.finished:
            break  # the server then aborts the engine's request
    return outs


def _final_equal(got: dict, want: dict) -> None:
    for key in ("prompt_token_ids", "prompt_logprobs", "finished"):
        assert got[key] == want[key], key
    for g, w in zip(got["outputs"], want["outputs"], strict=True):
        assert g == w


CHAT = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=200),  # ends on the end-of-turn token
        SamplingParams(temperature=0, max_tokens=48, stop=["\n"]),
        SamplingParams(temperature=0, max_tokens=48, stop=["ue", "Green"], min_tokens=3),
        SamplingParams(temperature=0, max_tokens=48, stop=["\n"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=24, skip_special_tokens=False, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2, stop=["e"]),
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=20, logprobs=1),
    ],
    ids=["eos", "stop", "stop-min-tokens", "stop-included", "specials", "logprobs", "n3"],
)
def test_the_outputs_equal_the_detokenizing_engines(engines, params):
    own, bare = engines
    prompt = own.tokenizer.encode_chat(CHAT)

    async def run():
        return (
            await _reference(own, prompt, params),
            await _through_output_text(bare, own.tokenizer, prompt, params),
        )

    want, got = asyncio.run(run())
    _final_equal(got[-1], want[-1])
    for seq in range(params.n):  # what streams out only grows
        texts = [out["outputs"][seq]["text"] for out in got]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    if params.stop:  # the case ends where it means to
        assert any(o["stop_reason"] in params.stop for o in want[-1]["outputs"]), want[-1]
    elif params.max_tokens == 200:
        assert want[-1]["outputs"][0]["finish_reason"] == "stop", want[-1]  # the end-of-turn token


def test_an_engine_without_a_tokenizer_refuses_text_and_stop_strings(engines):
    _, bare = engines

    async def ask(prompt, params):
        async for _ in bare.generate("x", prompt, params):
            pass

    with pytest.raises(ValueError, match="prompt: this model has no tokenizer"):
        asyncio.run(ask("hello", SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        asyncio.run(ask([1, 2, 3], SamplingParams(max_tokens=2, stop=["x"])))
