"""The FP8 W8A8 scheme (EngineArgs.quantization "fp8"): weights float8_e4m3fn per output channel
with fp32 scales, quantized once from the bf16/fp16 checkpoint as it loads (the pack then holds them
quantized); activations quantized per token at run time (engine/quant/fp8_kernels.py).

Under tensor parallelism each rank quantizes its own slice: column-parallel rows keep their
channels' scales, a row-parallel rank scales its own input columns and the all-reduce sums the
already-scaled partial products. GPUs without FP8 tensor cores (compute capability below 8.9) are
refused at start, naming the GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.base import QuantConfig, QuantizedLinear, QuantizedRows
from engine.quant.fp8_kernels import FP8, fp8_linear, quantize_rows_reference

MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have FP8 tensor cores


def fp8_device_error(capability: tuple[int, int], gpu_name: str) -> str | None:
    """Why a GPU of this compute capability can't run FP8 W8A8, or None when it can."""
    if tuple(capability) >= MIN_CAPABILITY:
        return None
    major, minor = capability
    return (
        f"quantization: fp8 needs FP8 tensor cores (compute capability 8.9 or newer: L4, L40S, "
        f"RTX 4090, H100, H200), but {gpu_name} has compute capability {major}.{minor}; "
        "unset QUANTIZATION to serve the bf16/fp16 weights on this GPU (for an FP8 checkpoint: "
        "serve its bf16 original), or use an Ada or Hopper GPU"
    )


class Fp8Config(QuantConfig):
    name = "fp8"

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
        if row_parallel:
            return RowParallelFp8Linear(in_features, out_features, bias, dtype, device, comm)
        return Fp8Linear(in_features, out_features, bias, dtype, device)

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            return  # CPU: the torch reference path
        error = fp8_device_error(
            torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
        )
        if error is not None:
            raise ValueError(error)

    def check_model(self, model_config) -> None:
        if model_config.moe is not None:
            raise ValueError(
                f"quantization: fp8 is not supported for mixture-of-experts models yet "
                f"({model_config.architecture}: FP8 experts come later); unset QUANTIZATION to "
                "serve its bf16 weights"
            )


class Fp8Linear(QuantizedLinear):
    """y = x @ (weight * weight_scale[:, None])^T (+ b): weight [out, in] float8_e4m3fn,
    weight_scale [out] fp32, bias in the activation dtype."""

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
            torch.empty(out_features, in_features, dtype=FP8, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    @torch.no_grad()
    def load_weight_rows(self, start: int, end: int, rows: torch.Tensor | QuantizedRows) -> None:
        """Quantize high-precision weight rows [end - start, in] into rows [start, end), each with
        its own scale; e4m3 QuantizedRows (an FP8 checkpoint's) are kept with their scales."""
        if tuple(rows.shape) != (end - start, self.in_features):
            raise ValueError(
                f"weights: {tuple(rows.shape)} rows for an fp8 linear expecting "
                f"{(end - start, self.in_features)}"
            )
        if isinstance(rows, QuantizedRows) and rows.values.dtype == FP8:
            q, scale = rows.values, rows.scales
        else:
            if isinstance(rows, QuantizedRows):  # e5m2 values: quantized again as e4m3
                rows = rows.dequantize()
            q, scale = quantize_rows_reference(rows.to(self.weight.device))
        self.weight[start:end].copy_(q)
        self.weight_scale[start:end].copy_(scale.view(-1))

    @torch.no_grad()
    def fill_random(self, std: float, generator: torch.Generator) -> None:
        """N(0, std) weights, quantized like a checkpoint's (in slices of rows, to bound memory)."""
        step = max(1, (64 << 20) // (4 * self.in_features))
        for start in range(0, self.out_features, step):
            end = min(start + step, self.out_features)
            rows = torch.empty(end - start, self.in_features, device=self.weight.device)
            self.load_weight_rows(start, end, rows.normal_(0.0, std, generator=generator))

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            "fp8 e4m3 per channel"
        )


class RowParallelFp8Linear(Fp8Linear):
    """all_reduce(x_local @ dequant(W_local)^T) (+ b): this rank's input columns, its own scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device, comm):
        super().__init__(in_features, out_features, bias, dtype, device)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.layers.parallel import _need

        y = _need(self.comm).all_reduce(fp8_linear(x, self.weight, self.weight_scale))
        return y + self.bias if self.bias is not None else y
