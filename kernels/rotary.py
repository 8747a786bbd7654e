"""Rotary position embedding (neox / rotate-half layout) for q and k in one launch.

Matches kvmesh.worker.layers.rotary: float32 arithmetic with the float32 cos/sin tables
[max_positions, head_dim / 2], result cast back to the input dtype. q, k may be strided views
([T, H, D] with a contiguous last dimension); outputs are new contiguous tensors.

`apply_qk_norm_rotary` is Qwen3's per-head RMSNorm of q and k followed by the rotation, in one launch
instead of three: each head's row is normed as kvmesh.kernels.rms_norm does (the same reduction over
the whole row, the same roundings to the input dtype) and rotated from that rounded result, so its
output equals the three launches' bit for bit.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out, k_out, positions, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(positions + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * HALF + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + offs, mask=mask, other=0.0)
    if head < num_q_heads:
        src = q_ptr + token * stride_qt + head * stride_qh
        dst = q_out + (token * num_q_heads + head) * 2 * HALF
    else:
        src = k_ptr + token * stride_kt + (head - num_q_heads) * stride_kh
        dst = k_out + (token * num_k_heads + head - num_q_heads) * 2 * HALF
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offs, (x1 * cos - x2 * sin).to(q_out.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs, (x2 * cos + x1 * sin).to(q_out.dtype.element_ty), mask=mask)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, H, D], k [T, Hkv, D]; cos, sin [max_positions, D / 2] float32 contiguous."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens, num_q_heads + num_k_heads)](
            q, k, q_out, k_out, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            num_q_heads, num_k_heads, HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q_out, k_out


@triton.jit
def _qk_norm_rotary_kernel(q_ptr, k_ptr, q_out, k_out, wq_ptr, wk_ptr, positions, cos_ptr, sin_ptr,
                           stride_qt, stride_qh, stride_kt, stride_kh, num_q_heads, num_k_heads, eps,
                           HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(positions + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * HALF + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + offs, mask=mask, other=0.0)
    if head < num_q_heads:
        src = q_ptr + token * stride_qt + head * stride_qh
        dst = q_out + (token * num_q_heads + head) * 2 * HALF
        w_ptr = wq_ptr
    else:
        src = k_ptr + token * stride_kt + (head - num_q_heads) * stride_kh
        dst = k_out + (token * num_k_heads + head - num_q_heads) * 2 * HALF
        w_ptr = wk_ptr
    # the norm's reduction over the whole row at once, as rms_norm's kernel (the same float32 sum)
    row = tl.arange(0, 2 * BLOCK)
    whole = tl.load(src + row, mask=row < 2 * HALF, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(whole * whole, 0) / (2 * HALF) + eps)
    dtype = q_out.dtype.element_ty
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)  # the norm's output
    x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(dst + offs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF + offs, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def apply_qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                         k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary(rms_norm(q, q_weight), rms_norm(k, k_weight)) in one launch; q [T, H, D], k [T, Hkv, D]
    with contiguous last dimensions, weights [D] of q's dtype, cos / sin as apply_rotary's."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _qk_norm_rotary_kernel[(num_tokens, num_q_heads + num_k_heads)](
            q, k, q_out, k_out, q_weight, k_weight, positions, cos, sin, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), num_q_heads, num_k_heads, eps, HALF=half,
            BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q_out, k_out
