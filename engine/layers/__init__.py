"""Building blocks of the decoder template: RMSNorm, rotary embeddings, fused activations, plain
linear layers.

Each layer allocates its parameters empty on the target device and dtype; on CUDA they run fused
Triton kernels.
"""

from engine.layers.activation import silu_and_mul
from engine.layers.linear import Embedding, Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

__all__ = [
    "Embedding",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "compute_inv_freq",
    "silu_and_mul",
]
