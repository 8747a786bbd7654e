"""FP8 (e4m3) weights for the linear layers: `quantization="fp8"`, as vLLM's `--quantization fp8`
does for an unquantized checkpoint.

- Weights: quantized once after loading (each tensor-parallel rank its own shard), per tensor:
  weight_scale = amax / 448 (float32), weight = round(W / weight_scale) as float8_e4m3fn.
- Activations: a dynamic per-tensor scale computed on the device at every call (no host sync, so
  CUDA graphs capture it). In a captured decode batch the padding rows take part in the amax: the
  scale, never the real rows' products, depends on them.
- The product: on CUDA `torch._scaled_mm` (fp8 x fp8, float32 accumulation, output in the model's
  bf16); elsewhere (the CPU, other dtypes, shapes that are not multiples of 16) the same function in
  float32 from the dequantized operands, so the CPU tests check the math the GPU runs.

Embedding, LM head, norms and MoE experts stay in the model dtype (vLLM's choice for the first
three; MoE models are refused with quantization="fp8" until the fused MoE kernel takes FP8).
"""

from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
QUANTIZATIONS = ("fp8",)
_MIN_SCALE = 1e-12  # an all-zero tensor still gets a finite scale


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as float8_e4m3fn, its float32 scale of shape [1]): x ~= q.float() * scale."""
    scale = (x.abs().amax().float() / FP8_MAX).clamp(min=_MIN_SCALE).reshape(1)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """cuBLAS's FP8 GEMM: CUDA, bf16 output here, both inner and output dims multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) with W float8_e4m3fn [out, in] scaled by weight_scale [1]; x is quantized
    per tensor on the fly. Returns x's dtype."""
    out_dtype = x.dtype
    x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
    x_q, x_scale = quantize_per_tensor(x2)
    x_q = x_q.contiguous()  # _scaled_mm's first operand is row-major
    if _scaled_mm_fits(x2, weight):
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
            module.weight_scale = scale
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
