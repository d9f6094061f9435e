"""Linear and embedding layers whose parameters are allocated empty (no init pass) on the target
device and dtype.

The weight loader fills them; on CUDA a decode-sized input (few rows) takes the skinny Triton GEMM
instead of cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.skinny_gemm import skinny_applies, skinny_gemm


class Linear(nn.Module):
    """y = x @ W^T (+ b), W: [out_features, in_features]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if skinny_applies(x, self.weight):
            return skinny_gemm(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def one_row_operands(self) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        """(weight, its per-row scale: none, bias) for engine.layers.row_gemv's one-row kernel."""
        return self.weight, None, self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden], allocated empty like Linear."""

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
