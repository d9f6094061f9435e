"""Decode from CUDA graphs gives what eager decoding gives, and the CUDA sampler keeps the CPU
sampler's semantics.

Tiny random models of several families in float32 (so the two paths differ only by float32
rounding), batch sizes that pad up to a captured size, and a batch bigger than every graph (which
runs eager). CPU tests check the flag.
"""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, EngineArgs, SamplingParams
from engine.sampling import Sampler, SamplingRow, apply_top_k_top_p_min_p
from graph_parity import assert_same_generation, generate_recording
from tiny_models import make_tiny_model


def test_graph_flags_are_validated_and_sizes_capped():
    args = EngineArgs(model="x", max_num_seqs=40)
    assert args.enforce_eager is False
    assert args.graph_sizes() == [1, 2, 4, 8, 16, 32]
    assert EngineArgs(
        model="x", cuda_graph_sizes=[8, 3, 3, 600], max_num_seqs=512
    ).graph_sizes() == [3, 8]
    for bad, field in [
        (dict(enforce_eager="yes"), "enforce_eager"),
        (dict(cuda_graph_sizes=[0]), "cuda_graph_sizes"),
        (dict(cuda_graph_sizes=[]), "cuda_graph_sizes"),
        (dict(cuda_graph_sizes=4), "cuda_graph_sizes"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineArgs(model="x", **bad).validate()


def test_cpu_never_captures(tmp_path):
    make_tiny_model("llama", str(tmp_path))
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4)
    assert llm.engine.runner.graphs is None


def _generate(model_dir: str, prompts, enforce_eager: bool, **kw):
    return generate_recording(
        model_dir,
        prompts,
        "graphs",
        12,
        num_kv_blocks=256,
        enforce_eager=enforce_eager,
        cuda_graph_capture="start",
        **kw,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("batch", [1, 3, 5, 11])
def test_graph_decode_equals_eager(family, batch, tmp_path):
    make_tiny_model(family, str(tmp_path))
    g = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 40, (batch,), generator=g)
    ]
    eager, eager_replays, no_graphs = _generate(str(tmp_path), prompts, enforce_eager=True)
    graphed, replays, graphs = _generate(str(tmp_path), prompts, enforce_eager=False)
    assert no_graphs is None and not eager_replays
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    if batch <= 8:
        assert replays, "no decode step ran from a graph"
    else:
        assert not any(n > 8 for n in replays)  # bigger batches run eager
    assert_same_generation(eager, graphed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_keeps_cpu_semantics():
    gen = torch.Generator().manual_seed(0)
    logits = (2.0 * torch.randn(6, 1000, generator=gen)).cuda()
    sampler = Sampler()
    # top-k = 1 and temperature 0 are greedy, whatever the seed
    rows = [
        SamplingRow(
            SamplingParams(top_k=1, temperature=1.3),
            torch.Generator("cuda").manual_seed(i),
            [],
            [],
            [],
        )
        for i in range(3)
    ]
    rows += [SamplingRow(SamplingParams(temperature=0), None, [], [], []) for _ in range(3)]
    assert sampler(logits, rows).token_ids == logits.argmax(-1).tolist()

    # seeded rows: the same seed gives the same tokens, alone or among other rows; another seed
    # differs
    params = SamplingParams(temperature=1.0, top_p=0.95)

    def seeded(seed: int, others: int, steps: int = 16) -> list[int]:
        g = torch.Generator("cuda").manual_seed(seed)
        out = []
        for step in range(steps):
            noise = torch.randn(others, 1000, device="cuda")
            batch = torch.cat([noise, logits[:1]])
            rows = [
                SamplingRow(SamplingParams(temperature=0.7), None, [], [], [])
                for _ in range(others)
            ]
            rows.append(SamplingRow(params, g, [], out[:], []))
            out.append(sampler(batch, rows).token_ids[-1])
        return out

    alone = seeded(7, 0)
    assert seeded(7, 5) == alone and seeded(7, 31) == alone
    assert seeded(8, 0) != alone and len(set(alone)) > 1

    # every drawn token lies inside the top-p / top-k / min-p set the CPU code computes
    settings = [(5, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.2), (20, 0.8, 0.05)]
    cpu_logits = logits[:4].cpu()
    allowed = ~torch.isneginf(
        apply_top_k_top_p_min_p(
            cpu_logits.clone(),
            [s[0] for s in settings],
            [s[1] for s in settings],
            [s[2] for s in settings],
        )
    )
    g = torch.Generator("cuda").manual_seed(1)
    seen = [set() for _ in settings]
    for _ in range(200):
        rows = [
            SamplingRow(SamplingParams(top_k=k, top_p=p, min_p=m), g, [], [], [])
            for k, p, m in settings
        ]
        for i, tok in enumerate(sampler(logits[:4], rows).token_ids):
            assert allowed[i, tok], (settings[i], tok)
            seen[i].add(tok)
    assert all(len(s) > 1 for s in seen)  # really sampled, not stuck on the argmax


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_scheduling_equals_sync_on_the_gpu(tmp_path):
    """Step N+1 launched from step N's tokens still on the device (graph and eager steps,
    preemption, stops, seeded sampling, penalties, n > 1) gives the tokens sync scheduling gives,
    and frees every block."""
    make_tiny_model("llama", str(tmp_path))
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 40, (12,), generator=g)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16, n=2, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=24, stop_token_ids=list(range(3, 256, 9)), ignore_eos=True
        ),
        SamplingParams(
            temperature=0.8, seed=3, max_tokens=12, repetition_penalty=1.3, ignore_eos=True
        ),
    ] * 3
    results = {}
    for mode in (False, True):
        llm = LLM(
            model=str(tmp_path),
            dtype="float32",
            device="cuda",
            block_size=4,
            num_kv_blocks=48,
            max_model_len=128,
            cuda_graph_sizes=[1, 2, 4, 8],
            async_scheduling=mode,
        )
        outs = llm.generate(prompts, params)
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_kv_blocks
        results[mode] = (
            [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs],
            [o.outputs[0].cumulative_logprob for o in outs[::4]],
            stats.num_preemptions,
        )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results[True][0] == results[False][0]
    assert results[True][1] == pytest.approx(results[False][1], abs=1e-3)
    # 48 blocks of 4 tokens: preemption in both modes
    assert results[True][2] > 0 and results[False][2] > 0
    assert any(c[1] == "stop" for r in results[True][0] for c in r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_cuda_graphs_takes_every_size_left(tmp_path):
    make_tiny_model("llama", str(tmp_path))
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        device="cuda",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        cuda_graph_sizes=[1, 2, 4],
        cuda_graph_capture="lazy",
    )
    graphs = llm.engine.runner.graphs
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert sorted(graphs.graphs) == [1]  # lazy: only the size a step used
    assert llm.capture_cuda_graphs() > 0
    assert sorted(graphs.graphs) == [1, 2, 4]
    assert llm.capture_cuda_graphs() >= 0 and sorted(graphs.graphs) == [1, 2, 4]
