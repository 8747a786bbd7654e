"""FP8 (e4m3) weights for the linear layers: `quantization="fp8"`, as vLLM's `--quantization fp8`
does for an unquantized checkpoint.

- Weights: quantized once after loading (each tensor-parallel rank its own shard), per tensor:
  weight_scale = amax / 448 (float32), weight = round(W / weight_scale) as float8_e4m3fn.
- Activations: a dynamic scale per token (row), computed on the device at every call (no host
  sync, so CUDA graphs capture it): on CUDA one Triton launch (kvmesh.kernels.fp8_quant), elsewhere
  the same numbers in torch. A row's scale depends on that row only, so the padding rows of a
  captured decode batch change nothing, and one outlier token does not coarsen the others (vLLM's
  online fp8 takes one scale per tensor; per token is its "dynamic per-token" variant).
- The product: on CUDA `torch._scaled_mm` with row-wise scales (fp8 x fp8, float32 accumulation,
  each output scaled by its token's and its column's scale, output in the model's bf16; the weight's
  one scale is stored as a [1, out] row); elsewhere (the CPU, other dtypes, shapes that are not
  multiples of 16) the same function in float32 from the dequantized operands, so the CPU tests
  check the math the GPU runs.

Embedding, LM head, norms and MoE experts stay in the model dtype (vLLM's choice for the first
three; MoE models are refused with quantization="fp8" until the fused MoE kernel takes FP8).
"""

from __future__ import annotations

import torch
from torch import nn

from kvmesh.worker.layers.kernels import use_kernels

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
QUANTIZATIONS = ("fp8",)
_MIN_SCALE = 1e-12  # an all-zero tensor still gets a finite scale
_INV_FP8_MAX = 1.0 / FP8_MAX


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as float8_e4m3fn, its float32 scale of shape [1]): x ~= q.float() * scale."""
    scale = (x.abs().amax().float() / FP8_MAX).clamp(min=_MIN_SCALE).reshape(1)
    return _to_fp8(x, scale), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x as float8_e4m3fn, float32 scales [M, 1]), one scale per row; on CUDA one
    Triton launch computing the same numbers."""
    if use_kernels(x) and x.stride(-1) == 1:
        from kvmesh.kernels.fp8_quant import quantize_rows
        return quantize_rows(x, _MIN_SCALE)
    return quantize_per_token_torch(x)


def quantize_per_token_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # amax times 1/448 (a float32 constant), as the kernel: CUDA's division by a scalar multiplies
    # by its reciprocal, the CPU's divides, so this form is the one both devices compute alike
    scale = (x.abs().amax(dim=-1, keepdim=True).float() * _INV_FP8_MAX).clamp(min=_MIN_SCALE)
    return _to_fp8(x, scale), scale


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def row_scale(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """A weight's one scale [1] as the [1, out_features] row that row-wise _scaled_mm takes."""
    return scale.reshape(1, 1).expand(1, out_features).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """cuBLAS's FP8 GEMM: CUDA, bf16 output here, both inner and output dims multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) with W float8_e4m3fn [out, in] scaled by weight_scale ([1, out] as
    quantize_linear_weights stores it, or [1]); x is quantized per token on the fly. Returns x's
    dtype."""
    out_dtype = x.dtype
    x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
    x_q, x_scale = quantize_per_token(x2)  # x_q contiguous: _scaled_mm's first operand is row-major
    if _scaled_mm_fits(x2, weight):
        if weight_scale.dim() == 1:
            weight_scale = row_scale(weight_scale, weight.shape[0])
        # weight.t() of a contiguous [out, in] tensor is the column-major [in, out] operand it needs
        y = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=out_dtype)
    else:
        y = ((x_q.float() @ weight.float().t()) * (x_scale * weight_scale)).to(out_dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def quantize_linear_weights(model: nn.Module) -> int:
    """Replace every parallel linear layer's weight by its FP8 form (in place) and give it a
    `weight_scale`; returns how many layers were quantized."""
    from kvmesh.worker.layers.parallel import ColumnParallelLinear, RowParallelLinear

    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            q, scale = quantize_per_tensor(module.weight.data)
            module.weight = nn.Parameter(q, requires_grad=False)
            module.weight_scale = row_scale(scale, q.shape[0])  # stored as a row: no expand at each call
            count += 1
    return count


def check_quantization(quantization: str | None, device: torch.device, moe: bool) -> None:
    """Raise ValueError naming `quantization` when this model or device cannot take it."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if moe:
        raise ValueError("quantization='fp8' is not supported for mixture-of-experts models yet (the fused "
                         "MoE kernel takes bf16 experts); use quantization=None")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"quantization='fp8' needs a GPU of compute capability 8.9 or newer (Ada, "
                             f"Hopper); {torch.cuda.get_device_name(device)} is {major}.{minor}: "
                             f"use quantization=None")
