"""Prompt and mixed steps from piecewise CUDA graphs (engine/piecewise_graphs.py) give what eager
steps give.

CPU: the token buckets, and the stager's token padding (tokens of no sequence, at offsets set by the
token count alone). GPU: tiny random models of several families in float32 generate through chunked
prefill (a small token budget, so prompt chunks ride beside decodes) with the graphs, lazily and
captured at start, in the background (a bucket's steps eager while another thread records it),
and eagerly; tokens equal, logprobs within float32 rounding.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import smallest_at_least
from engine.piecewise_graphs import BUCKETS, MAX_TOKENS, token_buckets
from engine.step_inputs import InputStager, StepLayout
from graph_parity import assert_same_generation, generate_recording
from tiny_models import make_tiny_model


def test_token_buckets_cover_every_step_up_to_the_budget():
    assert token_buckets(8192) == list(BUCKETS) and BUCKETS[-1] == MAX_TOKENS
    assert token_buckets(512)[-1] == 512 and token_buckets(512) == [b for b in BUCKETS if b <= 512]
    assert token_buckets(600)[-2:] == [512, 608]  # the budget, rounded up to 16, is the last
    assert token_buckets(1) == [16]
    for budget in (1, 17, 300, 2047, 2048, 2049):
        buckets = token_buckets(budget)
        assert buckets == sorted(set(buckets)) and all(b % 16 == 0 for b in buckets)
        assert buckets[-1] >= min(budget, MAX_TOKENS)
    # a step pads up to the smallest bucket that holds it (the decode graphs' rule too)
    buckets = token_buckets(600)
    assert [smallest_at_least(buckets, n) for n in (1, 16, 17, 512, 513, 608)] == [
        16,
        16,
        32,
        512,
        608,
        608,
    ]
    assert smallest_at_least(buckets, 609) is None


def test_padding_tokens_belong_to_no_sequence():
    stager = InputStager(torch.device("cpu"), block_size=4)
    step = stager.stage(
        [5, 6, 7, 8], [0, 1, 2, 9], [0, 9], [3, 1], [[3], [1, 2, 7]], pad_tokens_to=16
    )
    assert step.input_ids.tolist() == [5, 6, 7, 8] + [0] * 12
    assert step.positions.tolist() == [0, 1, 2, 9] + [0] * 12
    assert step.meta.slot_mapping.tolist() == [12, 13, 14, 29] + [-1] * 12
    assert step.meta.query_start_loc.tolist() == [0, 3, 4]
    assert step.meta.seq_lens.tolist() == [3, 10]
    assert step.meta.num_seqs == 2 and step.meta.max_query_len == 3
    with pytest.raises(ValueError, match="pad_tokens_to"):
        stager.stage([5, 6], [0, 1], [0], [2], [[0]], pad_tokens_to=1)
    # a graph's static views sit where every step of that token count puts them
    a, _ = StepLayout(64, 2, 3).offsets()
    b, _ = StepLayout(64, 200, 40).offsets()
    for name in ("input_ids", "positions", "slot_mapping"):
        assert a[name] == b[name]


def test_cpu_runs_no_piecewise_graphs(tmp_path):
    make_tiny_model("llama", str(tmp_path))
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4)
    assert llm.engine.runner.pieces is None


def _generate(model_dir: str, prompts, enforce_eager: bool, capture: str = "lazy"):
    return generate_recording(
        model_dir,
        prompts,
        "pieces",
        10,
        num_kv_blocks=512,
        max_num_batched_tokens=48,
        enforce_eager=enforce_eager,
        cuda_graph_capture=capture,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2-window", "gemma3", "phi3"])
@pytest.mark.parametrize("capture", ["lazy", "start"])
def test_piecewise_steps_equal_eager(family, capture, tmp_path):
    make_tiny_model(family, str(tmp_path))
    g = torch.Generator().manual_seed(len(family))
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 90, (9,), generator=g)
    ]
    eager, eager_steps, none = _generate(str(tmp_path), prompts, enforce_eager=True)
    graphed, steps, pieces = _generate(str(tmp_path), prompts, False, capture)
    assert not eager_steps and none is None
    assert steps and max(steps) <= 48 and min(steps) > 1, steps
    # at start every bucket is captured; lazily, a bucket on its second step
    if capture == "start":
        assert sorted(pieces.captured) == [16, 32, 48]
    assert pieces.captured, "no step replayed its graphs"
    assert_same_generation(eager, graphed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_experts_run_their_prompt_steps_eagerly(tmp_path):
    make_tiny_model("qwen3-moe", str(tmp_path))
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", num_kv_blocks=64, block_size=4)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.pieces is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prompt_steps_captured_in_the_background_equal_eager(family, tmp_path, caplog):
    """With background capture on, a bucket's steps run eagerly (through the layers' own attention)
    while another thread records its graphs with attention cut on that thread alone, then replay:
    the tokens are the eager ones before and after, and no bucket was captured on the step loop."""
    make_tiny_model(family, str(tmp_path))
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 90, (9,), generator=g)
    ]
    eager, _, _ = _generate(str(tmp_path), prompts, enforce_eager=True)
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        device="cuda",
        block_size=4,
        max_model_len=128,
        cuda_graph_sizes=[1, 2, 4, 8],
        num_kv_blocks=512,
        max_num_batched_tokens=48,
    )
    pieces = llm.engine.runner.pieces
    pieces.background = True
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    with caplog.at_level(logging.INFO, logger="engine.piecewise_graphs"):
        runs = []
        for _ in range(2):
            outs = llm.generate(prompts, params)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
            deadline = time.monotonic() + 120
            while pieces.pending() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not pieces.pending()
    captures = [r.getMessage() for r in caplog.records if "-token steps in" in r.getMessage()]
    assert captures and pieces.captured, "no bucket was captured"
    assert all("in the background" in line for line in captures), captures
    for run in runs:
        assert_same_generation(eager, run)
    del llm, pieces
