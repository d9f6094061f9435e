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

from engine.layers.experts import StackedExperts
from engine.quant.base import QuantConfig, QuantizedLinear, QuantizedRows
from engine.quant.fp8_kernels import (
    FP8,
    QUANTIZED_ROW_PATHS,
    cuda_path,
    fp8_linear,
    quantize_rows_reference,
    quantized_rows_gemm,
    scaled_mm_fits,
)

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

    @property
    def experts(self) -> type[nn.Module]:
        return Fp8StackedExperts


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

    def one_row_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(weight, weight_scale, bias) for engine.layers.row_gemv's one-row kernel."""
        return self.weight, self.weight_scale, self.bias

    def takes_quantized_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether forward() of `rows` CUDA rows of `dtype` would quantize them per token for a
        tensor-core GEMM (its many-row paths): the kernel before may then write them quantized
        and hand them to forward_quantized (engine.layers.fused_linears: norm_linear,
        act_linear)."""
        return cuda_path(rows, dtype) in QUANTIZED_ROW_PATHS and scaled_mm_fits(self.weight)

    def forward_quantized(
        self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """forward() of rows already quantized per token: q e4m3 [M, in], scale fp32 [M, 1];
        the result in `dtype`."""
        return quantized_rows_gemm(q, scale, self.weight, self.weight_scale, self.bias, dtype)

    def load_weight_rows(self, start: int, end: int, rows: torch.Tensor | QuantizedRows) -> None:
        """Quantize high-precision weight rows [end - start, in] into rows [start, end), each with
        its own scale; e4m3 QuantizedRows (an FP8 checkpoint's) are kept with their scales."""
        load_rows(self.weight, self.weight_scale, start, end, rows, "an fp8 linear")

    def fill_random(self, std: float, generator: torch.Generator) -> None:
        """N(0, std) weights, quantized like a checkpoint's."""
        fill_random_rows(self.weight, self.weight_scale, std, generator)

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

    def forward_quantized(
        self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """forward() of this rank's input columns already quantized per token (their own
        scales), then the all-reduce."""
        from engine.layers.parallel import _need

        y = quantized_rows_gemm(q, scale, self.weight, self.weight_scale, None, dtype)
        y = _need(self.comm).all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def one_row_operands(self) -> None:
        """None: the one-row kernel has no all-reduce (engine.layers.row_gemv)."""
        return None


@torch.no_grad()
def load_rows(
    values: torch.Tensor,
    scales: torch.Tensor,
    start: int,
    end: int,
    rows: torch.Tensor | QuantizedRows,
    what: str,
) -> None:
    """Rows [start, end) of e4m3 `values` ([..., in], rows counted flattened to 2-D) and their fp32
    `scales` from high-precision rows (quantized per row here) or e4m3 QuantizedRows (kept)."""
    flat_values, flat_scales = values.view(-1, values.shape[-1]), scales.view(-1)
    if tuple(rows.shape) != (end - start, flat_values.shape[1]):
        raise ValueError(
            f"weights: {tuple(rows.shape)} rows for {what} expecting "
            f"{(end - start, flat_values.shape[1])}"
        )
    if isinstance(rows, QuantizedRows) and rows.values.dtype == FP8:
        q, scale = rows.values, rows.scales
    else:
        if isinstance(rows, QuantizedRows):  # e5m2 values: quantized again as e4m3
            rows = rows.dequantize()
        q, scale = quantize_rows_reference(rows.to(values.device))
    flat_values[start:end].copy_(q)
    flat_scales[start:end].copy_(scale.view(-1))


@torch.no_grad()
def fill_random_rows(
    values: torch.Tensor, scales: torch.Tensor, std: float, generator: torch.Generator
) -> None:
    """N(0, std) rows quantized as a checkpoint's would be, in slices that bound memory."""
    width = values.shape[-1]
    total = values.numel() // width
    step = max(1, (64 << 20) // (4 * width))
    for start in range(0, total, step):
        end = min(start + step, total)
        rows = torch.empty(end - start, width, device=values.device)
        load_rows(values, scales, start, end, rows.normal_(0.0, std, generator=generator), "")


class StackedRows:
    """What the loader asks of one FP8 stacked projection (load_weight_rows, fill_random): its
    rows counted as the stacked parameter flattened to [E * R, C]."""

    def __init__(self, values: nn.Parameter, scales: nn.Parameter, what: str) -> None:
        self.values, self.scales, self.what = values, scales, what

    def load_weight_rows(self, start: int, end: int, rows: torch.Tensor | QuantizedRows) -> None:
        load_rows(self.values, self.scales, start, end, rows, self.what)

    def fill_random(self, std: float, generator: torch.Generator) -> None:
        fill_random_rows(self.values, self.scales, std, generator)


class Fp8StackedExperts(StackedExperts):
    """A mixture-of-experts layer's experts (engine.layers.experts.StackedExperts' layout) with
    float8_e4m3fn weights and one fp32 scale per (expert, output row): gate_up_proj [E, 2I, H] with
    gate_up_proj_scale [E, 2I], down_proj [E, H, I] with down_proj_scale [E, H].

    The experts run W8A16: the kernels widen each weight tile to the activation dtype (the sorted
    path's tensor-core dot, the decode path's fp32 multiply-adds) and apply the scales to the sums;
    the activations are not quantized (the one-row dense decode does the same). On CPU the torch
    reference dequantizes one expert at a time."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype, device) -> None:
        super().__init__(num_experts, hidden, inter, FP8, device)
        for name, rows in (("gate_up_proj_scale", 2 * inter), ("down_proj_scale", hidden)):
            scale = torch.empty(num_experts, rows, dtype=torch.float32, device=device)
            self.register_parameter(name, nn.Parameter(scale, requires_grad=False))

    def quantized_parameters(self) -> dict[str, StackedRows]:
        """Parameter name -> what loads its rows (engine.models.decoder.quantized_linears)."""
        return {
            "gate_up_proj": StackedRows(self.gate_up_proj, self.gate_up_proj_scale, "fp8 experts"),
            "down_proj": StackedRows(self.down_proj, self.down_proj_scale, "fp8 experts"),
        }

    def expert_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj_scale, self.down_proj_scale

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
            "fp8 e4m3 per channel"
        )
