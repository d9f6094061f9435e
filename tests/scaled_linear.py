"""A linear whose weight is narrower than its input row, with one scale per output row (FP8's shape,
in fp16 so that the Triton interpreter runs it on CPU): the one-row kernel's tests use it where an
FP8 linear would go."""

from __future__ import annotations

import torch


class ScaledHalf(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.w, self.s = weight.half(), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.float().t()) * self.s

    def one_row_operands(self):
        return self.w, self.s, None
