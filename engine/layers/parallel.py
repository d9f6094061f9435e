"""Tensor-parallel layers: a row-parallel linear (each rank multiplies its input columns, one
all-reduce sums the parts, the bias is added once) and a vocabulary-parallel embedding (each rank
looks up the ids in its rows, one all-reduce merges them). Column-parallel linears need no layer of
their own: a plain Linear over a rank's rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear
from engine.layers.skinny_gemm import skinny_applies, skinny_gemm


def _need(comm):
    if comm is None:
        raise RuntimeError(
            "tensor parallel: this layer holds one rank's shard and has no communicator to run with"
        )
    return comm


class RowParallelLinear(Linear):
    """y = all_reduce(x_local @ W_local^T) (+ b): W_local is [out_features, in_features / ranks]."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype, device, comm
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = _need(self.comm)
        w = self.weight
        y = skinny_gemm(x, w) if skinny_applies(x, w) else F.linear(x, w)
        y = comm.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def one_row_operands(self) -> None:
        """None: the one-row kernel has no all-reduce (engine.layers.row_gemv)."""
        return None


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + rows) of the token table ([rows, dim], the last rank's padded with zero
    rows)."""

    def __init__(self, first: int, rows: int, dim: int, dtype, device, comm) -> None:
        super().__init__()
        self.first = first
        self.comm = comm
        table = torch.empty(rows, dim, dtype=dtype, device=device)
        self.weight = nn.Parameter(table, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        comm = _need(self.comm)
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return comm.all_reduce(out)
