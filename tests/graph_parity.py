"""Greedy generation on the GPU through CUDA graphs against eager steps (tests/test_cuda_graphs.py,
tests/test_piecewise_graphs.py): a run that records the token count of every step one graph path
runs, and the comparison of two runs' tokens and logprobs."""

from __future__ import annotations

import gc

import torch

from engine import LLM, SamplingParams


def generate_recording(model_dir: str, prompts, path: str, max_tokens: int, **engine_kwargs):
    """Greedy tokens with 3 logprobs per position from a float32 engine on CUDA, and the token count
    of each step that runner.<path> ran ("graphs": decode graphs, "pieces": piecewise prompt
    graphs). Returns (outputs, counts, that object or None); the engine is freed."""
    kwargs = dict(
        dtype="float32",
        device="cuda",
        block_size=4,
        max_model_len=128,
        cuda_graph_sizes=[1, 2, 4, 8],
    )
    llm = LLM(model=model_dir, **{**kwargs, **engine_kwargs})
    runner = llm.engine.runner
    graphs = getattr(runner, path)
    counts = []
    if graphs is not None:
        run = graphs.run

        def counting_run(token_ids, *args, **kw):
            counts.append(len(token_ids))
            return run(token_ids, *args, **kw)

        graphs.run = counting_run  # a spy: the real step still runs
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params)
    result = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return result, counts, graphs


def assert_same_generation(expected, actual, tolerance: float = 1e-4) -> None:
    """Equal tokens, and the same top logprobs within `tolerance` (float32 rounding)."""
    for (toks_e, lps_e), (toks_a, lps_a) in zip(expected, actual, strict=True):
        assert toks_a == toks_e
        for pe, pa in zip(lps_e, lps_a):
            assert pe.keys() == pa.keys()
            for t in pe:
                assert abs(pe[t].logprob - pa[t].logprob) < tolerance
