"""RMSNorm as the HF Llama/Qwen families compute it: normalise in float32, cast back, then scale by
the weight.

Optionally adds a residual first (one fused Triton kernel on CUDA); also Qwen3's per-head q/k norms
(last dim), and Gemma's (1 + w) variant (OffsetRMSNorm).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.fused import fused_kernels_available, rms_norm_fused


class RMSNorm(nn.Module):
    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual: (norm(x + residual), x + residual), the sum carried to the next
        layer."""
        if fused_kernels_available(x):
            normed, new_residual = rms_norm_fused(x, self.weight, self.eps, residual)
            return normed if residual is None else (normed, new_residual)
        if residual is None:
            return self.reference(x)
        residual = x + residual
        return self.reference(residual), residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The plain torch computation (the CPU path, and what the fused kernel is checked
        against)."""
        in_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32,
    (normalised(x) * (1 + w)) cast back; on CUDA the same fused kernel as Llama's, told so."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual: (norm(x + residual), x + residual)."""
        if fused_kernels_available(x):
            normed, new_residual = rms_norm_fused(x, self.weight, self.eps, residual, offset=True)
            return normed if residual is None else (normed, new_residual)
        if residual is None:
            return self.reference(x)
        residual = x + residual
        return self.reference(residual), residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
