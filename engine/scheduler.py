"""The scheduler: picks each step's sequences and how many tokens each computes, under the token
budget.

Continuous batching with chunked prefill: running sequences go first (oldest first), each taking a
decode token or its next prefill chunk; waiting sequences fill what budget is left. When blocks run
out, the youngest running sequence is preempted (its blocks freed, recomputed later), so the oldest
requests are always served first.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.kv import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computed this step, starting at seq.num_computed_tokens

    @property
    def completes(self) -> bool:
        """After this step every token is computed, so the step samples the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark seq finished, take it out of whichever queue holds it and free its blocks."""
        if seq.is_finished:
            return
        was_running = seq.status is SequenceStatus.RUNNING
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.num_pending = 0  # a token still on the device for it is dropped when it arrives
        queue = self.running if was_running else self.waiting
        if seq in queue:
            queue.remove(seq)
        self.kv.free(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kept: list[Sequence] = []
        # self.running stays the old list until `kept` replaces it (another thread's stats read it
        # meanwhile: never an empty list while sequences run). queue[head:end] are the running
        # sequences not yet scheduled; victims are taken from the end.
        queue = self.running
        head, end = 0, len(queue)
        while head < end and budget > 0:
            seq = queue[head]
            head += 1
            if seq.num_pending and seq.reaches_length_limit:
                kept.append(seq)  # finishes once its pending token arrives: nothing to compute
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, num_new):
                if head < end:  # the youngest still unscheduled
                    end -= 1
                    victim = queue[end]
                else:
                    victim = seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                kept.append(seq)
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        kept.extend(queue[head:end])  # running sequences the budget did not reach this step
        self.running = kept

        if out.preempted:  # blocks are short: admit nobody new this step
            return out
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if seq.num_pending:
                # preempted while its last token is still on the device: admitted once it is known
                break
            parent = seq.parent
            if (
                parent is not None
                and parent.status is SequenceStatus.RUNNING
                and (parent.num_computed_tokens < parent.num_prompt_tokens)
            ):
                i += 1  # wait until sample 0 has computed the prompt, then share its blocks
                continue
            cached = self._adopt_prefix(seq)
            num_new = min(
                seq.num_tokens - seq.num_computed_tokens - len(cached) * self.kv.block_size, budget
            )
            if not self.kv.allocate(seq, num_new, cached):
                self.kv.free(seq)  # drop blocks shared from the parent, if any; retried next step
                seq.num_computed_tokens = 0
                break  # first come, first served: nobody younger jumps the queue
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_order)  # before it leaves waiting (stats, above)
            self.waiting.pop(i)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def _adopt_prefix(self, seq: Sequence) -> list[int]:
        """Share sample 0's prompt blocks (n > 1), or look the prompt up in the prefix cache."""
        parent = seq.parent
        if parent is not None and parent.status is SequenceStatus.RUNNING and not seq.block_table:
            shareable = min(
                (seq.num_prompt_tokens - 1) // self.kv.block_size, len(parent.block_table)
            )
            shareable = min(shareable, parent.num_computed_tokens // self.kv.block_size)
            if shareable > 0:
                self.kv.share_prefix(seq, parent, shareable)
                return []
        if seq.wants_prompt_logprobs:
            return []  # every prompt position must be computed to give its logprobs
        return self.kv.find_cached_prefix(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.free(seq)
        seq.reset_for_recompute()
        self.num_preemptions += 1
        out.preempted.append(seq)
        bisect.insort(self.waiting, seq, key=_order)


def _order(seq: Sequence) -> tuple[int, int]:
    return (seq.arrival, seq.index)
