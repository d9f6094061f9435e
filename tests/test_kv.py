"""Unit tests of the block pool and prefix cache (pure bookkeeping, no model)."""

from __future__ import annotations

from engine.kv import KVCacheManager, hash_block
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from engine.sequence import Request, Sequence

_ids = iter(range(10**6))


def make_seq(tokens: list[int], arrival: int = 0) -> Sequence:
    req = Request(
        f"r{arrival}",
        arrival,
        None,
        list(tokens),
        SamplingParams(temperature=0),
        RequestMetrics(0.0),
    )
    seq = Sequence(next(_ids), req, 0, list(tokens), len(tokens), max_total_tokens=10**6)
    req.seqs.append(seq)
    return seq


def run_prefill(kv: KVCacheManager, seq: Sequence) -> None:
    cached = kv.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(cached) * kv.block_size
    assert kv.allocate(seq, num_new, cached)
    seq.num_computed_tokens += num_new
    kv.cache_full_blocks(seq)


def test_allocate_and_free_return_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_seq(list(range(10))), make_seq(list(range(100, 105)))
    assert kv.allocate(a, 10) and len(a.block_table) == 3
    assert kv.allocate(b, 5) and len(b.block_table) == 2
    assert kv.num_free_blocks == 3
    assert not kv.allocate(make_seq(list(range(16))), 16)  # needs 4, 3 free
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8
    assert kv.stats().peak_used_blocks == 5


def test_prefix_hit_shares_blocks_and_refcounts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prefix = list(range(12))  # 3 full blocks
    a = make_seq(prefix + [50, 51])
    run_prefill(kv, a)
    b = make_seq(prefix + [60, 61, 62])
    hits = kv.find_cached_prefix(b)
    assert hits == a.block_table[:3]
    run_prefill_with = kv.allocate(b, b.num_tokens - 12, hits)
    assert run_prefill_with
    assert b.num_computed_tokens == 12
    assert all(kv.blocks[i].ref_count == 2 for i in hits)
    kv.free(a)
    assert all(kv.blocks[i].ref_count == 1 for i in hits)
    kv.free(b)
    # freed but still cached: a third request hits them while they sit in the free queue
    c = make_seq(prefix + [70])
    assert kv.find_cached_prefix(c) == hits
    assert kv.stats().prefix_cache_hit_tokens == 12


def test_full_hit_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(8)))
    run_prefill(kv, a)
    b = make_seq(list(range(8)))
    assert len(kv.find_cached_prefix(b)) == 1  # block 2 would leave nothing to compute


def test_hash_collision_is_a_miss():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(kv, a)
    # Forge a collision: register the block under the hash another token block would have.
    b = make_seq([9, 9, 9, 9, 5])
    forged = hash_block(None, [9, 9, 9, 9])
    block = kv.blocks[a.block_table[0]]
    kv.cached[forged] = block.block_id
    assert kv.find_cached_prefix(b) == []


def test_lru_eviction_takes_the_oldest_cached_block_and_keeps_unhashed_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3])  # one full block (hashed) + one partial
    run_prefill(kv, a)
    b = make_seq([7, 8, 9])
    run_prefill(kv, b)
    kv.free(a)
    kv.free(b)
    assert len(kv.cached) == 2
    # Two new blocks: the two partial (unhashed) blocks are handed out before any cached one.
    c = make_seq([20, 21, 22, 23])
    assert kv.allocate(c, 4)
    assert len(kv.cached) == 2
    # One more: evicts a's block (freed earlier, least recently used), keeps b's.
    d = make_seq([30, 31])
    assert kv.allocate(d, 2)
    assert len(kv.cached) == 1
    assert kv.find_cached_prefix(make_seq([7, 8, 0])) != []
    assert kv.find_cached_prefix(make_seq([1, 2, 0])) == []


def test_chained_hash_depends_on_the_whole_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(kv, a)
    # Same second block, different first block: no hit at all.
    assert kv.find_cached_prefix(make_seq([9, 9, 3, 4, 5])) == []
    assert len(kv.find_cached_prefix(make_seq([1, 2, 3, 4, 6]))) == 2


def test_allocation_with_cached_blocks_counts_the_tokens_after_them():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a = make_seq(list(range(13)))  # 3 full blocks + 1
    run_prefill(kv, a)
    kv.free(a)
    # 3 cached blocks, then 8 new tokens: 2 more blocks
    b = make_seq(list(range(12)) + list(range(50, 58)))
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 3
    assert kv.can_allocate(b, 8, hits)  # 5 blocks in all
    c = make_seq(list(range(12)) + list(range(50, 62)))  # 3 cached + 12 new tokens: 6 blocks > 5
    assert not kv.can_allocate(c, 12, kv.find_cached_prefix(c))
