"""RMSNorm over the last dimension in one launch (torch runs ~7 kernels for it).

Rounds like the reference (Hugging Face's and kvmesh.worker.layers.norm): normalise in float32, cast
to the input dtype, then multiply by the weight. Works on [N, D] and on [T, H, D] views whose rows are
strided (q / k split off a fused qkv projection), writing a contiguous output.

`add_rms_norm` is the residual form in one launch: sum = x + residual rounded to the input dtype (as
torch's bf16 add), then the same RMSNorm of that sum, bit for bit; it returns both (the norm feeds
the next layer's input, the sum is the new residual stream).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_outer, stride_inner, num_inner, eps,
                     D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    outer = row // num_inner
    inner = row % num_inner
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + outer * stride_outer + inner * stride_inner + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)
    y = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.result_type(x, weight) if weight.dtype != x.dtype else x.dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, D] or [T, H, D] with a contiguous last dimension; returns a contiguous tensor like x."""
    d = x.shape[-1]
    if x.stride(-1) != 1 or x.dim() not in (2, 3):
        x = x.reshape(-1, d).contiguous()
    if x.dim() == 2:
        stride_outer, stride_inner, num_inner = x.stride(0), 0, 1
    else:
        stride_outer, stride_inner, num_inner = x.stride(0), x.stride(1), x.shape[1]
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    rows = out.numel() // d
    if rows:
        _rms_norm_kernel[(rows,)](x, weight, out, stride_outer, stride_inner, num_inner, eps,
                                  D=d, BLOCK_D=triton.next_power_of_2(d), num_warps=4 if d >= 1024 else 1)
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    total = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * D + offs, total, mask=mask)
    x = total.to(tl.float32)  # what the unfused norm reads back
    rstd = tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)
    y = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for contiguous [N, D] x and residual of one dtype."""
    n, d = x.shape
    total = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    if n:
        _add_rms_norm_kernel[(n,)](x, residual, weight, out, total, eps, D=d, BLOCK_D=triton.next_power_of_2(d),
                                   num_warps=4 if d >= 1024 else 1)
    return out, total
