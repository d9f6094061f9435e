"""engine/structured.py's bitmask on the GPU: the same masked logits as on the CPU, at a
Llama-3-sized vocabulary and batch 64 (imports only torch and the engine, as the GPU machine has
them)."""

from __future__ import annotations

import pytest
import torch

from engine.token_bitmask import apply_token_bitmask


@pytest.mark.gpu
def test_apply_token_bitmask_on_the_gpu_matches_the_cpu():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, 4008), dtype=torch.int32, generator=gen)
    bitmask[3] = -1
    for vocab in (128256, 128000, 128300):  # the mask's width, a narrower and a wider logits row
        logits = torch.randn(64, vocab, generator=gen)
        expected = apply_token_bitmask(logits.clone(), bitmask)
        got = apply_token_bitmask(logits.cuda(), bitmask.cuda())
        assert torch.equal(got.cpu(), expected)
        assert torch.isfinite(got[3, :128256]).all()


@pytest.mark.gpu
def test_the_engine_on_the_gpu_keeps_every_reply_in_its_grammar(tmp_path):
    """The engine's own grammar path on the GPU: async scheduling reads the step in flight inside
    the next launch, the mask lands after the decode CUDA graph; a random-weight model at
    temperature 1 ends every reply of a batch with a document of the schema."""
    import json

    from engine import LLM, SamplingParams
    from engine.structured import StructuredOutputs
    from tests.chat_fixtures import write_chat_model

    model = write_chat_model(tmp_path, "hermes", weights=True)
    llm = LLM(model=str(model), device="cuda", dtype="bfloat16", max_model_len=1024)
    assert llm.engine.async_scheduling and llm.engine.runner.graphs is not None
    schema = {
        "type": "object",
        "properties": {
            "city": {"enum": ["paris", "tokyo"]},
            "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    spec = StructuredOutputs(json=schema, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=spec)
        for i in range(24)
    ]
    outs = llm.generate(["the weather"] * 24, params)
    for out in outs:
        doc = json.loads(out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"
        assert set(doc) == {"city", "days"} and doc["city"] in ("paris", "tokyo")
        assert all(isinstance(d, int) and 0 <= d <= 9 for d in doc["days"])
