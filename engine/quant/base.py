"""The interface every quantization scheme implements: what the model builder, the weight loader,
the pack and the start-up checks ask of it. Holds no kernels and no model knowledge."""

from __future__ import annotations

import torch
from torch import nn


class QuantConfig:
    """A quantization scheme. `name` goes into the pack's key and file name, so a pack written for
    one scheme (or none) is never read for another."""

    name: str = ""
    # a mixture-of-experts layer's experts in this scheme (engine.layers.experts.StackedExperts'
    # constructor and forward); None: MoE models are refused with the scheme
    experts: type[nn.Module] | None = None

    def linear(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None,
        comm=None,
        row_parallel: bool = False,
    ) -> nn.Module:
        """A quantized y = x @ W^T (+ b) with activations in `dtype`; row_parallel: the input
        columns are this rank's slice and the partial products are all-reduced through `comm`."""
        raise NotImplementedError

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError (naming the GPU) when the scheme can't run on `device`."""

    def check_model(self, model_config) -> None:
        """Raise ValueError when the scheme can't serve this model (one message naming both): a
        mixture-of-experts model when the scheme has no experts."""
        if model_config.moe is not None and self.experts is None:
            raise ValueError(
                f"quantization: {self.name} has no mixture-of-experts layers "
                f"({model_config.architecture}); unset QUANTIZATION to serve its own dtype"
            )


class QuantizedRows:
    """Weight rows that arrive already quantized (an FP8 checkpoint's): FP8 values [rows, in] and
    one fp32 scale per row. A quantized linear takes them as they are; anything else reads the
    high-precision values."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        self.values = values
        self.scales = scales.float().reshape(-1).expand(values.shape[0])

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None]


class QuantizedLinear(nn.Module):
    """What the loader asks of a quantized linear: its weight rows, high precision (quantized into
    place) or QuantizedRows (kept as they are) (load_weight_rows), and random weights (fill_random)
    for load_format "dummy"."""

    def load_weight_rows(self, start: int, end: int, rows: torch.Tensor | QuantizedRows) -> None:
        raise NotImplementedError

    def fill_random(self, std: float, generator: torch.Generator) -> None:
        raise NotImplementedError
