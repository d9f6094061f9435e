"""Decode graphs captured off the step loop (GPU): once the worker's warm-up has loaded the kernel
set, a step whose batch size has no graph yet replays a larger captured graph or runs eagerly while
another thread captures its size; the tokens are those of graphs captured inline and of eager
decoding.
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import free_gpu_memory
from engine import LLM, SamplingParams
from tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[3 + i, 11, 7 * i % 50 + 1, 19] * (1 + i) for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _llm(model_dir: str, **kw) -> LLM:
    return LLM(
        model=model_dir,
        dtype="bfloat16",
        device="cuda",
        max_model_len=128,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
        cuda_graph_sizes=[1, 2, 4, 8],
        **kw,
    )


def _wait_captured(graphs, sizes, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not set(sizes) <= set(graphs.graphs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(sizes) <= set(graphs.graphs), sorted(graphs.graphs)


def test_background_capture_gives_the_tokens_of_inline_capture_and_eager(tmp_path):
    from warmup.ready import warm_kernels

    model_dir = str(tmp_path / "m")
    make_tiny_model("qwen3", model_dir)
    tokens = {}
    for name, kw in (
        ("eager", dict(enforce_eager=True)),
        ("inline", dict(cuda_graph_capture="start")),
    ):
        llm = _llm(model_dir, **kw)
        tokens[name] = [
            [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], GREEDY)] for n in (1, 3, 8)
        ]
        del llm
        free_gpu_memory()
    llm = _llm(model_dir)
    warm = warm_kernels(llm, "jit")
    assert warm.loaded.wait(600)
    graphs = llm.engine.runner.graphs
    # nothing captured yet, nothing captured inline
    assert graphs.background and graphs.graphs == {}
    tokens["background"] = [
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], GREEDY)] for n in (1, 3, 8)
    ]
    _wait_captured(graphs, [1, 4, 8])
    tokens["replayed"] = [
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], GREEDY)] for n in (1, 3, 8)
    ]
    assert tokens["background"] == tokens["inline"] == tokens["eager"] == tokens["replayed"]
    del llm, graphs
    free_gpu_memory()


def test_a_step_without_its_graph_replays_a_larger_one_and_queues_its_size(tmp_path):
    model_dir = str(tmp_path / "m")
    make_tiny_model("llama", model_dir)
    llm = _llm(model_dir)
    graphs = llm.engine.runner.graphs
    graphs.capture([8])
    # the tiny model's kernels are loaded by the capture above
    graphs.prepare_size = lambda size: None
    graphs.background = True
    replays = []
    original = graphs.graphs[8].replay
    # (noqa: pyflakes reads the lambda after the `del` below; it only runs before it)
    graphs.graphs[8].replay = lambda: (replays.append(8), original())[1]  # noqa: F821
    expected = [o.outputs[0].token_ids for o in _outputs(llm, 3)]
    assert replays, "batch 3 ran from the graph of 8 while 4 was captured"
    _wait_captured(graphs, [4])
    assert [o.outputs[0].token_ids for o in _outputs(llm, 3)] == expected
    del llm, graphs, original
    free_gpu_memory()


def _outputs(llm, n):
    return llm.generate(PROMPTS[:n], GREEDY)
