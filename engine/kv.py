"""The paged KV cache's bookkeeping: a block pool with reference counts, block tables, and the
prefix cache.

Full blocks are published under a chained hash of their tokens (each hash covers the whole prefix).
A lookup checks the block's own tokens and its parent hash, so a hash collision can never serve
wrong K/V. Freed blocks stay cached until evicted, least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    parent_hash: bytes | None = None
    tokens: tuple[int, ...] | None = None


@dataclass
class KVStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    peak_used_blocks: int


def hash_block(parent_hash: bytes | None, tokens: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"root")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class KVCacheManager:
    """Hands out KV blocks to sequences. Knows token ids and block ids, never tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently used first. Cached blocks are evicted from the front when
        # handed out again.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.peak_used = 0

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> KVStats:
        return KVStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=len(self.cached),
            prefix_cache_queried_tokens=self.queried_tokens,
            prefix_cache_hit_tokens=self.hit_tokens,
            peak_used_blocks=self.peak_used,
        )

    def _update_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full_blocks):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the prefix cache holding the longest cached prefix of seq, leaving at least one
        token to compute (its logits are needed for sampling)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._update_hashes(seq, max_blocks)
        hits: list[int] = []
        bs = self.block_size
        for i in range(max_blocks):
            block_id = self.cached.get(seq.block_hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            parent = seq.block_hashes[i - 1] if i else None
            if block.parent_hash != parent or block.tokens != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break  # a hash collision: treat as a miss
            hits.append(block_id)
        self.queried_tokens += seq.num_tokens
        return hits

    # ---- allocation ------------------------------------------------------------------------------
    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()
    ) -> bool:
        computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        need = (
            self.blocks_for(computed + num_new_tokens) - len(seq.block_table) - len(cached_blocks)
        )
        # Cached hits that sit in the free queue are taken out of it, so they are not free for new
        # blocks.
        reserved = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return need <= self.num_free_blocks - reserved

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give seq the blocks for num_new_tokens more tokens (after adopting cached_blocks). False
        if it can't."""
        if not cached_blocks and (
            seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size
        ):
            return True  # its blocks already hold them (most decode steps)
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            return False
        for block_id in cached_blocks:
            self._take(block_id)
            seq.block_table.append(block_id)
        if cached_blocks:
            cached_tokens = len(cached_blocks) * self.block_size
            seq.num_computed_tokens = cached_tokens
            seq.num_hashed_blocks = len(cached_blocks)
            self.hit_tokens += cached_tokens
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict it from the prefix cache
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash = block.parent_hash = block.tokens = None
            block.ref_count = 1
            seq.block_table.append(block_id)
        self.peak_used = max(self.peak_used, self.num_blocks - self.num_free_blocks)
        return True

    def share_prefix(self, child: Sequence, parent: Sequence, num_blocks: int) -> None:
        """The n > 1 samples of one request reference the prompt blocks of sample 0 instead of
        recomputing them."""
        assert not child.block_table
        for block_id in parent.block_table[:num_blocks]:
            self._take(block_id)
            child.block_table.append(block_id)
        child.num_computed_tokens = num_blocks * self.block_size
        child.num_hashed_blocks = min(num_blocks, parent.num_hashed_blocks)
        child.block_hashes = list(parent.block_hashes[:num_blocks])

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_queue.pop(block_id)
        block.ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks go to the free queue first, so they are evicted before
        the prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash is None:  # nothing worth keeping: hand it out before any cached block
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish seq's newly completed full blocks (all tokens computed and known on the host) in
        the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        self._update_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is None and h not in self.cached:
                block.hash = h
                block.parent_hash = seq.block_hashes[i - 1] if i else None
                block.tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.cached[h] = block.block_id
        seq.num_hashed_blocks = num_full
