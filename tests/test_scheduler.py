"""Unit tests of the scheduler's policy: token budget, chunked prefill, FCFS, preemption (no
model)."""

from __future__ import annotations

from engine.kv import KVCacheManager
from engine.scheduler import Scheduler
from engine.sequence import SequenceStatus
from test_kv import make_seq


def advance(sched: Scheduler, out, token: int = 1) -> None:
    """Pretend the model ran: mark the scheduled tokens computed and append `token` where the step
    samples."""
    for s in out.scheduled:
        completes = s.completes
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.kv.cache_full_blocks(s.seq)
        if completes:
            s.seq.token_ids.append(token)


def test_chunked_prefill_shares_the_budget_with_decodes():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    a = make_seq(list(range(3)), arrival=0)
    sched.add(a)
    advance(sched, sched.schedule())  # a prefilled, now decoding
    b = make_seq(list(range(100, 120)), arrival=1)  # 20-token prompt
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]
    assert not out.scheduled[1].completes
    advance(sched, out)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]
    advance(sched, out)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 6)]
    assert out.scheduled[1].completes


def test_max_num_seqs_caps_the_running_set():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq([i, i + 1], arrival=i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert sched.waiting == seqs[2:]


def test_preemption_takes_the_youngest_and_it_comes_back_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    old = make_seq([1, 2, 3], arrival=0)  # 2 blocks
    young = make_seq([4, 5, 6], arrival=1)  # 2 blocks
    sched.add(old)
    sched.add(young)
    advance(sched, sched.schedule())
    assert kv.num_free_blocks == 0
    advance(sched, sched.schedule())  # both decode within their second block (4 tokens each)
    out = sched.schedule()  # old needs a 3rd block: young is preempted
    assert out.preempted == [young]
    assert [s.seq for s in out.scheduled] == [old]
    assert young.status is SequenceStatus.WAITING and young.num_computed_tokens == 0
    assert young.block_table == [] and sched.num_preemptions == 1
    newer = make_seq([7], arrival=2)
    sched.add(newer)
    assert sched.waiting == [young, newer]  # the preempted request keeps its place in the line


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_youngest():
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    old = make_seq([1, 2, 3, 4], arrival=0)  # 2 blocks
    young = make_seq([5], arrival=1)  # 1 block
    sched.add(old)
    sched.add(young)
    advance(sched, sched.schedule())
    young.token_ids += [9]  # young decodes: now needs a 2nd block... while old needs a 3rd
    young.num_computed_tokens += 1
    out = sched.schedule()
    assert young in out.preempted and old in [s.seq for s in out.scheduled]


def test_stats_never_read_an_empty_queue_while_a_step_is_scheduled():
    """Another thread (the worker's warm-up, waiting for the engine to be idle) reads
    len(running) + len(waiting) while schedule() runs: every read taken inside schedule() (at each
    KV allocation) counts every sequence."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    reads: list[int] = []
    allocate = kv.allocate

    def observed(*args, **kwargs):
        reads.append(len(sched.running) + len(sched.waiting))
        return allocate(*args, **kwargs)

    kv.allocate = observed
    seqs = [make_seq([i, i + 1, i + 2], arrival=i) for i in range(3)]
    sched.add(seqs[0])
    advance(sched, sched.schedule())  # one decoding
    for s in seqs[1:]:
        sched.add(s)
    for _ in range(3):  # admissions, then decodes of all three
        advance(sched, sched.schedule())
    assert reads and min(reads) >= 1
    assert reads[-3:] == [3, 3, 3]
