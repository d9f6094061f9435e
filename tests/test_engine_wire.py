"""engine.wire, which carries requests and outputs between `serve`'s two processes: sampling
parameters survive JSON unchanged, and a real engine's cumulative outputs, sent as deltas through
JSON, come back equal to the engine's own, output by output (SmolLM2 on CPU: real tokenizer,
logprobs, several sequences, stop strings, a grammar)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from engine import AsyncLLM, SamplingParams
from engine.structured_outputs import StructuredOutputs
from engine.wire import (
    OutputAssembly,
    OutputDeltas,
    params_from_wire,
    params_to_wire,
    stats_from_wire,
    stats_to_wire,
)


def _through_json(data):
    return json.loads(json.dumps(data))


def test_sampling_params_survive_json():
    params = SamplingParams(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        seed=7,
        stop=["\n\n", "END"],
        stop_token_ids=[2],
        max_tokens=16,
        logprobs=3,
        prompt_logprobs=1,
        logit_bias={5: -100.0, 17: 2.5},
        structured_outputs=StructuredOutputs(json={"type": "object"}, start_after_token=4),
    )
    back = params_from_wire(_through_json(params_to_wire(params)))
    assert back == params
    assert back.logit_bias == {5: -100.0, 17: 2.5}  # int keys, not JSON's strings
    assert isinstance(back.structured_outputs, StructuredOutputs)
    assert params_from_wire(_through_json(params_to_wire(None))) is None


def test_an_invalid_parameter_is_refused_on_the_engines_side_too():
    data = _through_json(params_to_wire(SamplingParams(max_tokens=4)))
    data["temperature"] = -1
    with pytest.raises(ValueError, match="temperature"):
        params_from_wire(data).validate()


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    llm = AsyncLLM(model=smollm2_dir, dtype="float32", device="cpu", max_model_len=512)
    yield llm
    llm.shutdown()


def _copy(out):
    """A deep copy of an output as it was when yielded (the engine shares its metrics object)."""
    return json.loads(json.dumps(dataclasses.asdict(out)))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, logprobs=2, prompt_logprobs=2),
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, stop=[" the", "."]),
        SamplingParams(
            temperature=0,
            max_tokens=24,
            structured_outputs=StructuredOutputs(choice=["yes", "no", "maybe so"]),
        ),
    ],
    ids=["logprobs", "n3-stop", "grammar"],
)
def test_a_real_engines_outputs_come_back_equal_through_deltas(engine, params):
    async def run() -> list:
        pairs = []
        deltas, assembly = OutputDeltas(), OutputAssembly("r")
        prompt = engine.tokenizer.encode("The capital of France is")
        async for out in engine.generate("r", prompt, params):
            rebuilt = assembly.apply(_through_json(deltas.delta(out)))
            pairs.append((_copy(out), _copy(rebuilt)))
        return pairs

    pairs = asyncio.run(run())
    assert len(pairs) > 1
    for own, rebuilt in pairs:
        assert rebuilt == own
    assert pairs[-1][1]["finished"]


def test_deltas_carry_only_what_is_new(engine):
    async def run() -> list[dict]:
        deltas, sent = OutputDeltas(), []
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        async for out in engine.generate("d", engine.tokenizer.encode("Hello"), params):
            sent.append(deltas.delta(out))
        return sent

    sent = asyncio.run(run())
    assert "prompt_token_ids" in sent[0] and all("prompt_token_ids" not in d for d in sent[1:])
    assert sum(len(d["outputs"][0]["token_ids"]) for d in sent) == 20


def test_engine_stats_survive_json(engine):
    stats = engine.stats()
    assert stats_from_wire(_through_json(stats_to_wire(stats))) == stats
