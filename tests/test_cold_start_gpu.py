"""GPU checks of the cold-start shortcuts: the analytic KV-sizing bound against a profiled step's
measured peak, lazily captured decode graphs against eager decoding, and a preloaded pack taken over
by the engine.

References: torch's own allocator statistics (the profiled peak), the eager path, and
safetensors-loaded weights.
"""

from __future__ import annotations

import gc

import pytest
import torch

from bench.checkpoint import synthesize
from engine import LLM, EngineArgs, SamplingParams
from engine.attention import select_backend
from engine.memory_budget import step_peak_bytes
from engine.models.weights import preload_weights
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _free() -> None:
    """Collect engines no longer referenced: an engine moves its start-up objects out of the cyclic
    GC (gc.freeze), so a test that builds several in one process hands them back first."""
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    return synthesize(
        "llama-3.2-1b.json", str(tmp_path_factory.mktemp("ckpt") / "llama-1b"), device="cuda"
    )


@pytest.mark.parametrize(
    "backend,num_tokens,num_rows",
    [("triton", 8192, 256), ("triton", 2048, 64), ("triton", 512, 512), ("torch", 1024, 256)],
)
def test_the_analytic_step_bound_covers_the_profiled_peak(llama_1b, backend, num_tokens, num_rows):
    _free()
    llm = LLM(
        model=llama_1b,
        dtype="bfloat16",
        device="cuda",
        max_model_len=8192,
        num_kv_blocks=64,
        enforce_eager=True,
    )
    runner = llm.engine.runner
    runner.model.wait_weights()
    if backend == "torch":
        ref = select_backend("cuda", "torch")
        for layer in runner.model.layers:
            layer.self_attn.backend = ref
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    measured = runner._profile_gpu_blocks(num_tokens, num_rows) - held
    bound = step_peak_bytes(runner.model_config, 2, num_tokens, num_rows, backend)
    assert measured <= bound, (measured / 2**20, bound / 2**20)
    # not so loose it wastes KV
    assert bound <= 2 * measured + (512 << 20), (measured / 2**20, bound / 2**20)
    del llm, runner
    _free()


def test_analytic_kv_sizing_stays_within_the_budget_through_the_largest_step(llama_1b):
    _free()
    total = torch.cuda.mem_get_info()[1]
    blocks = {}
    for mode in ("profile", "analytic"):
        llm = LLM(
            model=llama_1b,
            dtype="bfloat16",
            device="cuda",
            max_model_len=8192,
            max_num_batched_tokens=8192,
            gpu_memory_utilization=0.5,
            kv_sizing=mode,
        )
        blocks[mode] = llm.engine.num_kv_blocks
        # the largest prefill, then sampling with top-p on every row it can have
        if mode == "analytic":
            prompt = [(11 * i) % 30000 + 5 for i in range(8000)]
            out = llm.generate(
                [prompt], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, ignore_eos=True)
            )
            assert len(out[0].outputs[0].token_ids) == 4
            torch.cuda.synchronize()
            free, _ = torch.cuda.mem_get_info()
            assert total - free <= 0.5 * total + (256 << 20), (total - free) / total
        del llm
        _free()
    assert 0.9 * blocks["profile"] <= blocks["analytic"] <= blocks["profile"], blocks


def test_lazily_captured_graphs_decode_as_eager_and_capture_only_the_sizes_used(tmp_path):
    _free()
    make_tiny_model("llama", str(tmp_path))
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = {}
    for eager in (True, False):
        llm = LLM(
            model=str(tmp_path),
            dtype="float32",
            device="cuda",
            block_size=4,
            num_kv_blocks=128,
            max_model_len=128,
            enforce_eager=eager,
            cuda_graph_sizes=[1, 2, 4, 8],
        )
        graphs = llm.engine.runner.graphs
        if not eager:
            assert graphs is not None and graphs.graphs == {}  # nothing captured at start
        outs[eager] = [
            (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)
        ]
        if not eager:
            assert sorted(graphs.graphs) == [4] and graphs.capture_seconds > 0  # batch 3 pads to 4
        del llm, graphs
        _free()
    assert [ids for ids, _ in outs[True]] == [ids for ids, _ in outs[False]]
    for (_, a), (_, b) in zip(outs[True], outs[False]):
        for pa, pb in zip(a, b):
            assert pa.keys() == pb.keys() and all(
                abs(pa[k].logprob - pb[k].logprob) < 1e-4 for k in pa
            )


def test_a_preloaded_pack_is_what_the_engine_runs_on(tmp_path):
    model_dir = str(tmp_path / "model")
    make_tiny_model("qwen2", model_dir)
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    opts = dict(model=model_dir, dtype="float32", device="cuda", num_kv_blocks=64)
    ref = [
        o.outputs[0].token_ids
        for o in LLM(load_format="safetensors", **opts).generate(prompts, params)
    ]
    LLM(**opts)  # writes the pack
    _free()  # neither engine is referenced any more
    assert preload_weights(EngineArgs(**opts)) is True
    llm = LLM(**opts)
    model = llm.engine.runner.model
    assert model.load_stats["source"] == "pack"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    model.wait_weights()
    assert model.load_stats["nbytes"] > 0 and model.load_stats["gbps"] > 0
    assert preload_weights(EngineArgs(load_format="safetensors", **opts)) is False
    del llm, model
    _free()
