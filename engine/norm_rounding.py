"""The RMSNorm's weighting as the Triton kernels of engine.layers and engine.attention compute it,
rounded where torch's layers round (engine.layers.norm: RMSNorm.reference, OffsetRMSNorm.reference):
Llama's norm rounds normalised(x) to the activation dtype, then multiplies by w and rounds again;
Gemma's multiplies by (1 + w) in float32 and rounds once. One helper, so the residual-add + RMSNorm
kernel, the RoPE kernel's per-head q/k norm and the decode attention's agree by construction.
"""

from __future__ import annotations

try:  # a CPU-only install may have no triton; nothing here runs then
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

if triton is not None:

    @triton.jit
    def weighted_norm(x, rstd, w, OFFSET: tl.constexpr, dtype: tl.constexpr):
        """norm(x) in `dtype` from x and w in float32 and rstd = 1 / rms (broadcast to x); OFFSET:
        Gemma's (1 + w)."""
        if OFFSET:
            return (x * rstd * (1.0 + w)).to(dtype)
        return ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype)
