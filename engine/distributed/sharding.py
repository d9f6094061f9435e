"""How a decoder splits over tensor-parallel ranks (Megatron style): which heads, MLP columns and
vocabulary rows each rank holds. Pure arithmetic on the ModelConfig; the model code turns it into
parameter shapes and HF slices.

Attention heads and the MLP's intermediate columns split evenly; KV heads split too, or, when there
are fewer KV heads than ranks, each rank keeps the one KV head its query heads read (replicated).
The vocabulary splits into equal row blocks, the last one padded with zero rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """This process's part of a model split over `size` ranks (rank 0 of 1: the whole model)."""

    rank: int = 0
    size: int = 1

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming tensor_parallel_size when the model does not split over `size`
        ranks."""
        n = self.size
        if n == 1:
            return
        if cfg.moe is not None:
            raise ValueError(
                f"tensor_parallel_size: {n}: mixture-of-experts models ({cfg.architecture}) "
                "are not split over GPUs yet; use tensor_parallel_size 1"
            )
        problem = None
        if cfg.num_heads % n:
            problem = f"does not divide the model's {cfg.num_heads} attention heads"
        elif cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            problem = f"and the model's {cfg.num_kv_heads} KV heads: one must divide the other"
        elif cfg.intermediate_size % n:
            problem = f"does not divide the model's intermediate size {cfg.intermediate_size}"
        elif cfg.family == "phi3":  # one HF tensor would fill three slices of each rank's
            problem = f"is not supported for {cfg.architecture} yet (checkpoint-fused qkv_proj)"
        if problem:
            raise ValueError(f"tensor_parallel_size: {n} {problem}")

    def q_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first query head, count) of this rank."""
        count = cfg.num_heads // self.size
        return self.rank * count, count

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first KV head, count): a split when there are at least as many KV heads as ranks, else
        the one KV head this rank's query heads share."""
        if cfg.num_kv_heads >= self.size:
            count = cfg.num_kv_heads // self.size
            return self.rank * count, count
        return self.rank * cfg.num_kv_heads // self.size, 1

    def intermediate(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first column, count) of the MLP's intermediate dimension."""
        count = cfg.intermediate_size // self.size
        return self.rank * count, count

    def vocab(self, cfg: ModelConfig) -> tuple[int, int, int]:
        """(first row, real rows, padded rows) of the embedding and lm_head this rank holds."""
        padded = -(-cfg.vocab_size // self.size)
        first = self.rank * padded
        return first, max(0, min(padded, cfg.vocab_size - first)), padded

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's slice of each layer: its heads, KV heads and intermediate
        columns."""
        if self.size == 1:
            return cfg
        return dataclasses.replace(
            cfg,
            num_heads=self.q_heads(cfg)[1],
            num_kv_heads=self.kv_heads(cfg)[1],
            intermediate_size=self.intermediate(cfg)[1],
        )


SINGLE = Shard()
