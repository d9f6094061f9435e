"""Review tests of the engine's bookkeeping: block refcounts, the prefix cache, preemption, n > 1
sharing, stop rules and AsyncLLM streams, on a tiny random model: random workloads checked against
invariants, and regression tests.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import threading

import pytest
import torch

from engine import LLM, AsyncLLM, SamplingParams
from engine.kv import KVCacheManager
from engine.scheduler import Scheduler
from engine.sequence import SequenceStatus
from test_kv import make_seq
from test_scheduler import advance
from tiny_models import add_char_tokenizer, make_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", str(d))
    return str(d)


@pytest.fixture(scope="module")
def tiny_tok_dir(tiny_dir, tmp_path_factory) -> str:
    """The tiny model plus a one-character-per-token tokenizer, so stop strings work."""
    d = tmp_path_factory.mktemp("tiny-llama-tok")
    shutil.copytree(tiny_dir, d, dirs_exist_ok=True)
    add_char_tokenizer(str(d))
    return str(d)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Greedy tokens of a prompt run alone through a roomy engine without prefix caching
    (memoised)."""
    llm = LLM(
        model=tiny_dir,
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=256,
        enable_prefix_caching=False,
    )
    memo: dict = {}

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            memo[key] = llm.generate([prompt], params)[0].outputs[0].token_ids
        return memo[key]

    return run


def tiny_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model=model_dir, dtype="float32", device="cpu", block_size=BLOCK, **kwargs)


# --------------------------------------------------------------------------------------------------
# Invariants of the block pool, checked after every step
# --------------------------------------------------------------------------------------------------


def check_invariants(core, fingerprints: dict) -> None:
    kv = core.kv
    live = [s for r in core.requests.values() for s in r.seqs if not s.is_finished]
    refs = [0] * kv.num_blocks
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), "a block twice in one table"
        for b in s.block_table:
            refs[b] += 1
        if s.status is SequenceStatus.WAITING:
            assert not s.block_table, "a waiting sequence holds blocks"
            assert s.num_computed_tokens == 0
        assert s.num_computed_tokens <= len(s.block_table) * kv.block_size
        assert s.num_computed_tokens < s.num_tokens or s.status is SequenceStatus.WAITING
    for b, block in enumerate(kv.blocks):
        assert block.ref_count == refs[b], (
            f"block {b}: ref_count {block.ref_count}, held by {refs[b]} tables"
        )
        assert (block.ref_count == 0) == (b in kv.free_queue), (
            f"block {b} free-queue membership is wrong"
        )
    assert len(kv.free_queue) == refs.count(0)
    for h, b in kv.cached.items():
        assert kv.blocks[b].hash == h
    for block in kv.blocks:
        if block.hash is not None:
            assert kv.cached.get(block.hash) == block.block_id
    # A published block's K/V never changes while it stays published under the same hash (a
    # recompute of the same tokens after eviction may differ by float noise, hence the tolerance).
    cache = core.runner.kv_cache
    for block in kv.blocks:
        if block.hash is None:
            continue
        now = cache[:, :, block.block_id]
        key = (block.block_id, block.hash)
        if key in fingerprints:
            assert torch.allclose(fingerprints[key], now, atol=1e-4), (
                f"published block {block.block_id} changed"
            )
        else:
            fingerprints[key] = now.clone()
    # The computed full blocks of a live sequence hold its own tokens.
    for s in live:
        for i, b in enumerate(s.block_table[: s.num_computed_tokens // kv.block_size]):
            tokens = kv.blocks[b].tokens
            if tokens is not None:
                assert tokens == tuple(s.token_ids[i * kv.block_size : (i + 1) * kv.block_size])


def random_workload(
    model_dir, reference, seed, num_kv_blocks, budget, max_num_seqs, caching, num_requests=16
):
    rng = random.Random(seed)
    llm = tiny_llm(
        model_dir,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=caching,
    )
    core = llm.engine
    base = [rng.randrange(3, 256) for _ in range(40)]  # a common prefix for some prompts
    requests, finals, aborted = {}, {}, set()
    fingerprints: dict = {}
    added = 0
    while added < num_requests or core.has_unfinished():
        if added < num_requests and rng.random() < 0.5:
            length = rng.randrange(1, 30)
            if rng.random() < 0.5:
                prompt = base[:length] + [rng.randrange(3, 256) for _ in range(rng.randrange(0, 3))]
            else:
                prompt = [rng.randrange(3, 256) for _ in range(length)]
            max_tokens, n = rng.randrange(1, 12), rng.choice([1, 1, 2, 3])
            prompt_lp = rng.choice([None, None, 2])
            rid = f"r{added}"
            added += 1
            core.add_request(
                rid,
                prompt,
                SamplingParams(
                    temperature=0.0,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    n=n,
                    prompt_logprobs=prompt_lp,
                ),
            )
            requests[rid] = (prompt, max_tokens, prompt_lp)
        # abort anything: waiting, mid-prefill, decoding, n > 1
        if core.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(core.requests))
            core.abort(rid)
            aborted.add(rid)
        if core.has_unfinished():
            for out in core.step():
                if out.finished:
                    finals[out.request_id] = out
        check_invariants(core, fingerprints)
    assert llm.stats().num_free_blocks == num_kv_blocks
    assert all(b.ref_count == 0 for b in core.kv.blocks)
    for rid, (prompt, max_tokens, prompt_lp) in requests.items():
        if rid in aborted:
            continue
        out = finals[rid]
        expected = reference(prompt, max_tokens)[: core.context_limit - len(prompt)]
        for c in out.outputs:
            assert c.token_ids == expected, (rid, c.index)
        if prompt_lp is not None:
            assert len(out.prompt_logprobs) == len(prompt), rid
            assert out.prompt_logprobs[0] is None and all(
                p is not None for p in out.prompt_logprobs[1:]
            )
    return llm.stats()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "num_kv_blocks,budget,max_num_seqs,caching",
    [(12, 8, 4, True), (10, 16, 8, False), (20, 5, 3, True), (11, 64, 16, True)],
)
def test_random_workloads_free_every_block_and_match_alone(
    tiny_dir, reference, seed, num_kv_blocks, budget, max_num_seqs, caching
):
    random_workload(tiny_dir, reference, seed, num_kv_blocks, budget, max_num_seqs, caching)


def test_random_workloads_do_preempt_and_hit_the_prefix_cache(tiny_dir, reference):
    """The workloads above exercise what they are meant to (else they would pass vacuously)."""
    stats = [random_workload(tiny_dir, reference, 100 + s, 12, 8, 4, True) for s in range(2)]
    assert sum(s.num_preemptions for s in stats) > 0
    assert sum(s.prefix_cache_hit_tokens for s in stats) > 0


# --------------------------------------------------------------------------------------------------
# Pure bookkeeping: n > 1 sharing with preemption of the parent or the child
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("victim", ["parent", "child"])
def test_shared_prompt_blocks_survive_preemption_of_parent_or_child(caching, victim):
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=caching)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    parent = make_seq(list(range(10, 23)))  # 13 tokens: 3 full prompt blocks shareable
    child = make_seq(list(range(10, 23)))
    child.request, child.index, child.parent = parent.request, 1, parent
    parent.request.seqs.append(child)
    sched.add(parent)
    sched.add(child)
    advance(sched, sched.schedule(), token=7)  # parent prefills; child waits for it
    assert child.status is SequenceStatus.WAITING
    advance(sched, sched.schedule(), token=7)  # child shares 3 blocks, computes the rest
    assert child.block_table[:3] == parent.block_table[:3]
    shared = parent.block_table[:3]
    assert all(kv.blocks[b].ref_count == 2 for b in shared)
    seq = parent if victim == "parent" else child
    out = type("O", (), {"preempted": []})()
    sched.running.remove(seq)
    sched._preempt(seq, out)
    other = child if seq is parent else parent
    assert all(kv.blocks[b].ref_count == 1 for b in shared)
    assert other.block_table[:3] == shared
    for _ in range(6):
        advance(sched, sched.schedule(), token=7)
    for s in (parent, child):
        sched.finish(s, "length")
    assert kv.num_free_blocks == 16 and all(b.ref_count == 0 for b in kv.blocks)


def test_abort_of_waiting_child_and_mid_prefill_parent_frees_everything():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    # a 13-token prompt needs 3 chunks
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=5)
    parent = make_seq(list(range(10, 23)))
    child = make_seq(list(range(10, 23)))
    child.request, child.index, child.parent = parent.request, 1, parent
    sched.add(parent)
    sched.add(child)
    advance(sched, sched.schedule(), token=7)
    assert 0 < parent.num_computed_tokens < parent.num_prompt_tokens
    for s in (parent, child):
        sched.finish(s, "abort")
    assert kv.num_free_blocks == 16 and not sched.has_unfinished()


# --------------------------------------------------------------------------------------------------
# prompt_logprobs: neither computed twice nor skipped under chunked prefill and preemption
# --------------------------------------------------------------------------------------------------


def test_prompt_logprobs_under_chunking_and_preemption_equal_those_alone(tiny_dir):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (27, 19, 22, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=3, n=2)
    alone = [tiny_llm(tiny_dir, num_kv_blocks=128).generate([p], params)[0] for p in prompts]
    llm = tiny_llm(tiny_dir, num_kv_blocks=12, max_num_batched_tokens=6)
    busy = llm.generate(prompts, params)
    assert llm.stats().num_preemptions > 0
    for a, b in zip(alone, busy):
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == len(a.prompt_token_ids)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert abs(pa[t].logprob - pb[t].logprob) < 1e-4
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert llm.stats().num_free_blocks == 12


# --------------------------------------------------------------------------------------------------
# Stop rules
# --------------------------------------------------------------------------------------------------

PROMPT = [5, 6, 7, 8, 9]


def test_stop_token_ids_and_eos_are_held_off_until_min_tokens(tiny_dir):
    llm = tiny_llm(tiny_dir, num_kv_blocks=64)
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[
        0
    ].outputs[0]
    first = free.token_ids[0]
    out = llm.generate(
        [PROMPT],
        SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, min_tokens=3, stop_token_ids=[first]
        ),
    )[0].outputs[0]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]
    if out.finish_reason == "stop":
        assert out.stop_reason == first and out.token_ids[-1] == first


def test_stop_strings_are_held_off_until_min_tokens(tiny_tok_dir):
    llm = tiny_llm(tiny_tok_dir, num_kv_blocks=64)
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[
        0
    ].outputs[0]
    stop = free.text[0]  # the text of the first generated token
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, min_tokens=4, stop=[stop]),
    )[0].outputs[0]
    assert len(out.token_ids) >= 4, (out.token_ids, out.finish_reason, out.stop_reason)


def test_num_cached_tokens_never_exceeds_the_prompt(tiny_dir):
    """After preemption by recompute, a request re-admitted with a prefix-cache hit over its own
    prompt AND generated tokens reports num_cached_tokens > len(prompt) (and a request preempted
    without a hit reports 0 even though its prompt was served from the cache at first)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (12, 10, 9, 11)]
    llm = tiny_llm(tiny_dir, num_kv_blocks=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert llm.stats().num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.num_cached_tokens <= len(p), (o.num_cached_tokens, len(p))


# --------------------------------------------------------------------------------------------------
# AsyncLLM
# --------------------------------------------------------------------------------------------------

LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


async def test_async_abort_mid_prefill_and_of_n_gt_1_frees_blocks(tiny_dir):
    engine = AsyncLLM(
        model=tiny_dir,
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=64,
        max_num_batched_tokens=4,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, n=3)
        gen = engine.generate("a", list(range(10, 40)), params)  # 30 tokens: 8 prefill steps
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)
        await engine.abort("a")
        stats = engine.stats()
        assert (
            stats.num_free_blocks == stats.num_kv_blocks
            and stats.num_running == stats.num_waiting == 0
        )
        final = await asyncio.wait_for(task, 5)
        # an output from before the abort may come first; the stream still ends
        while not final.finished:
            final = await asyncio.wait_for(gen.__anext__(), 5)
        assert all(c.finish_reason == "abort" for c in final.outputs)
    finally:
        engine.shutdown()


async def test_async_shutdown_ends_in_flight_streams(tiny_dir):
    engine = AsyncLLM(
        model=tiny_dir, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64
    )
    gen = engine.generate("a", list(range(10, 20)), LONG)
    await gen.__anext__()
    await asyncio.to_thread(engine.shutdown)

    async def drain():
        async for _ in gen:
            pass

    try:
        # an error or a final output are both fine; waiting forever is not
        await asyncio.wait_for(drain(), 3)
    except RuntimeError:
        pass
    except TimeoutError:
        pytest.fail("the stream never ended after shutdown")


async def test_reused_request_id_never_sees_the_old_requests_output(tiny_dir):
    """A client disconnects from request "x" while a step is running; a new "x" is submitted at
    once. The running step's output for the old "x" is delivered by request_id only, so it lands in
    the new stream (with the old prompt and tokens)."""
    engine = AsyncLLM(
        model=tiny_dir, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64
    )
    core = engine.engine
    orig_step = core.step
    gate = {"hold_after": False, "hold_before": False}
    entered, release_after, release_before = threading.Event(), threading.Event(), threading.Event()
    held_before = threading.Event()

    def step():
        if gate["hold_before"]:
            gate["hold_before"] = False
            held_before.set()
            release_before.wait(5)
        outs = orig_step()
        if gate["hold_after"]:
            gate["hold_after"] = False
            entered.set()
            release_after.wait(5)
        return outs

    core.step = step
    try:
        old_prompt, new_prompt = list(range(10, 20)), list(range(100, 105))
        old = engine.generate("x", old_prompt, LONG)
        await old.__anext__()
        gate["hold_after"] = True
        # the engine thread is inside a step that produced old "x" output
        await asyncio.to_thread(entered.wait, 5)
        # the client goes away: its stream is dropped, abort queued
        closing = asyncio.ensure_future(old.aclose())
        for _ in range(5):
            await asyncio.sleep(0)
        new = engine.generate(
            "x", new_prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        )
        first = asyncio.ensure_future(new.__anext__())
        for _ in range(5):
            await asyncio.sleep(0)
        # the step after: hold back the new request's own outputs for a while
        gate["hold_before"] = True
        release_after.set()
        # the abort of the old "x" and the add of the new one ran
        await asyncio.to_thread(held_before.wait, 5)
        await asyncio.sleep(0.05)
        release_before.set()
        try:
            out = await asyncio.wait_for(first, 5)
        # refusing the id while the old request is still being dropped is fine too
        except ValueError:
            out = None
        await asyncio.wait_for(closing, 5)
        if out is not None:
            assert out.prompt_token_ids == new_prompt
            async for _ in new:
                pass
    finally:
        release_after.set()
        release_before.set()
        engine.shutdown()
