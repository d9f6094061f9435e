"""Tensor parallelism on CPU: two processes over gloo run the whole engine (scheduler on rank 0,
plans broadcast, sampling on rank 0) and must give what one process gives, in float32, through
prefix caching, preemption, async scheduling, chunked prefill and seeded sampling; each rank's pack
holds its slice and the slices reassemble to the full weights; a rank that dies fails the requests
in flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
import torch

from cache.loader import load_pack
from engine import LLM, AsyncLLM, SamplingParams
from engine.config import ModelConfig
from engine.distributed.launch import RankDied
from engine.distributed.plan import StepPlan
from engine.distributed.sharding import Shard
from engine.models.weights import load_model, pack_path
from tiny_models import make_tiny_model

BLOCK = 4
PREFIX = list(range(40, 64))  # most prompts share it: its whole blocks come from the prefix cache


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tp-llama")
    make_tiny_model("llama", str(d))
    return str(d)


def _engine_kwargs(**extra) -> dict:
    # Few blocks: the batch does not fit, so the scheduler preempts; a small token budget chunks the
    # prefills.
    defaults = dict(
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=16,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        load_format="safetensors",
    )
    return {**defaults, **extra}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )


def _assert_same(ref, got) -> None:
    """Same tokens, and logprobs of the same top tokens equal to float32 rounding."""
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
        pairs += list(zip(a.prompt_logprobs or [], b.prompt_logprobs or []))
        for x, y in pairs:
            if x is None:
                assert y is None
                continue
            assert set(x) == set(y)
            for token in x:
                assert abs(x[token].logprob - y[token].logprob) < 1e-5


def test_tp2_matches_tp1_through_the_engine(llama_dir):
    prompts = [PREFIX + [100 + i, 7, 8 + i] for i in range(3)] + [[3, 4, 5]]
    seeded = SamplingParams(
        temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=2
    )
    params = [_greedy(12), _greedy(12), seeded, _greedy(12)]
    single = LLM(model=llama_dir, **_engine_kwargs())
    ref = single.generate(prompts, params)
    ref_stats = single.stats()
    # Async scheduling: a step's ids still on rank 0's device reach rank 1 through a broadcast.
    tp = LLM(model=llama_dir, tensor_parallel_size=2, async_scheduling=True, **_engine_kwargs())
    try:
        got = tp.generate(prompts, params)
        stats = tp.stats()
        # Rank 0 holds half the vocabulary (and half of every layer).
        assert tp.engine.runner.model.embed_tokens.weight.shape[0] == 128
    finally:
        tp.shutdown()
    _assert_same(ref, got)
    assert ref_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert stats.prefix_cache_hit_tokens == ref_stats.prefix_cache_hit_tokens > 0


def test_an_fp8_kv_cache_splits_with_the_heads(llama_dir):
    """Each rank's FP8 cache holds its own KV heads, quantized element by element as one process
    quantizes them: the same tokens and logprobs as one process with an FP8 cache, preempted and
    chunked."""
    prompts = [PREFIX + [100 + i, 7, 8 + i] for i in range(3)]
    params = [_greedy(12)] * 3
    kwargs = _engine_kwargs(kv_cache_dtype="fp8")
    ref = LLM(model=llama_dir, **kwargs).generate(prompts, params)
    tp = LLM(model=llama_dir, tensor_parallel_size=2, **kwargs)
    try:
        assert tp.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        got = tp.generate(prompts, params)
    finally:
        tp.shutdown()
    _assert_same(ref, got)


@pytest.mark.parametrize(
    "family, config",
    [
        ("mistral", {}),
        ("qwen3-tied", {}),
        ("llama", {"attention_bias": True}),
        ("gemma3", {}),
        ("gemma2", {}),
    ],
)
def test_each_family_splits(family, config, tmp_path):
    """mistral: one KV head (replicated on both ranks) and a sliding window; qwen3-tied: per-head
    q/k norms, head_dim 32, a vocabulary-parallel lm_head tied to the embedding; llama with
    attention_bias: q/k/v biases split with their heads, o_proj's bias added once, after the
    all-reduce; gemma3: (1 + w) q/k norms per head, local and global layers, scaled embeddings
    gathered from the vocabulary shards."""
    make_tiny_model(family, str(tmp_path), **config)
    prompts = [list(range(5, 30)), [9, 10, 11]]
    kwargs = _engine_kwargs(num_kv_blocks=None)
    ref = LLM(model=str(tmp_path), **kwargs).generate(prompts, _greedy(12))
    tp = LLM(model=str(tmp_path), tensor_parallel_size=2, **kwargs)
    try:
        _assert_same(ref, tp.generate(prompts, _greedy(12)))
    finally:
        tp.shutdown()


# ---- per-rank packs ------------------------------------------------------------------------------
def _unshard(cfg: ModelConfig, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full parameters from each rank's, by the Megatron rules written out here (not by the
    model's own map)."""
    n, d = len(ranks), cfg.head_dim
    q = cfg.num_heads // n * d
    kv = (cfg.num_kv_heads // n if cfg.num_kv_heads >= n else 1) * d
    # One copy of each KV head: every rank's when they split, else every (n / kv heads)-th rank's.
    owners = range(n) if cfg.num_kv_heads >= n else range(0, n, n // cfg.num_kv_heads)
    inter = cfg.intermediate_size // n
    full = {}
    for name in ranks[0]:
        parts = [r[name] for r in ranks]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            full[name] = torch.cat(parts)[: cfg.vocab_size]
        elif ".qkv_proj." in name:
            full[name] = torch.cat(
                [p[:q] for p in parts]
                + [parts[r][q : q + kv] for r in owners]
                + [parts[r][q + kv :] for r in owners]
            )
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            full[name] = torch.cat(parts, dim=1)
        elif name.endswith("gate_up_proj.weight"):
            full[name] = torch.cat([p[:inter] for p in parts] + [p[inter:] for p in parts])
        else:  # norms (and any o_proj bias): replicated
            assert all(torch.equal(p, parts[0]) for p in parts), name
            full[name] = parts[0]
    return full


def _cut_vocabulary(model_dir, vocab: int) -> None:
    """Keep the first `vocab` rows of the saved embedding and lm_head (config.json says so too)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tables = ("embed_tokens", "lm_head")
    tensors = load_file(path)
    tensors = {k: v[:vocab] if any(t in k for t in tables) else v for k, v in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))


@pytest.mark.parametrize(
    "family, size, vocab",
    [("llama", 2, 256), ("mistral", 2, 256), ("qwen2", 4, 250), ("llama-tied", 2, 255)],
)
def test_rank_packs_reassemble_to_the_full_weights(family, size, vocab, tmp_path):
    """Each rank streams only its pack: its slice of the weights (less than the whole), in the
    engine's layout. A vocabulary the ranks don't split evenly pads the last rows with zeros."""
    make_tiny_model(family, str(tmp_path))
    if vocab != 256:
        _cut_vocabulary(tmp_path, vocab)
    cfg = ModelConfig.from_dir(str(tmp_path))
    whole = load_model(str(tmp_path), cfg, torch.float32, "cpu", load_format="safetensors")
    ranks, sizes = [], []
    for rank in range(size):
        shard = Shard(rank, size)
        load_model(str(tmp_path), cfg, torch.float32, "cpu", load_format="pack", shard=shard)
        load = load_pack(pack_path(str(tmp_path), torch.float32, shard=shard), "cpu")
        load.wait()
        ranks.append(dict(load.tensors))
        sizes.append(load.pack.data_nbytes)
        table = ranks[-1]["embed_tokens.weight"]
        assert not table[max(0, vocab - rank * table.shape[0]) :].any()  # the padding rows
    full = _unshard(cfg, ranks)
    expected = dict(whole.named_parameters())
    assert set(full) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(full[name], tensor), name
    whole_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert max(sizes) < whole_bytes * (1 / size + 0.2)


def test_step_plans_survive_encoding():
    plan = StepPlan([5, 6, 7, 9], [0, 12], [3, 1], [[4, 2], [7, 1, 3, 0]], [2, 3], [3], [1], 2)
    back = StepPlan.decode(plan.encode())
    assert list(back.ids) == plan.ids and back.starts == plan.starts and back.lens == plan.lens
    assert [list(t) for t in back.tables] == plan.tables and list(back.positions) == [0, 1, 2, 12]
    assert (back.logit_rows, back.fill_dst, back.fill_src, back.prev_rows) == ([2, 3], [3], [1], 2)


def test_a_model_that_does_not_split_is_refused(llama_dir):
    with pytest.raises(
        ValueError, match="tensor_parallel_size: 3 does not divide the model's 4 attention heads"
    ):
        LLM(model=llama_dir, tensor_parallel_size=3, **_engine_kwargs())
    with pytest.raises(ValueError, match="device"):
        LLM(model=llama_dir, tensor_parallel_size=2, **_engine_kwargs(device="cuda:1"))


def test_phi3_is_refused_before_the_ranks_start(tmp_path):
    make_tiny_model("phi3", str(tmp_path))
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 is not supported for Phi3"):
        LLM(model=str(tmp_path), tensor_parallel_size=2, **_engine_kwargs())


# ---- a rank's death ------------------------------------------------------------------------------
def test_a_dead_rank_fails_the_requests_in_flight(llama_dir):
    engine = AsyncLLM(model=llama_dir, tensor_parallel_size=2, **_engine_kwargs())
    (rank1,) = engine.engine.ranks.procs.values()

    async def run() -> BaseException:
        os.kill(rank1.pid, signal.SIGSTOP)  # rank 0's next step waits for it inside a collective
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        stream = engine.generate("victim", [5, 6, 7], params)
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.5)
        assert not pending.done()  # in flight: stuck on the stopped rank
        os.kill(rank1.pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(pending, 30)
            async for _ in stream:
                pass
        except BaseException as exc:  # noqa: BLE001 - what the stream ended with
            return exc
        raise AssertionError("the request finished although a rank died")

    t0 = time.monotonic()
    try:
        err = asyncio.run(run())
    finally:
        engine.shutdown()
    # The watcher's RankDied, or gloo's own error if the engine thread met the closed socket first.
    assert isinstance(err, RankDied) or "connection" in str(err).lower(), repr(err)
    assert engine.errored is not None and time.monotonic() - t0 < 30
    with pytest.raises(RuntimeError, match="engine is dead"):
        asyncio.run(engine.generate("after", [5], SamplingParams(max_tokens=1)).__anext__())
