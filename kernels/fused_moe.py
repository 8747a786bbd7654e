"""Fused mixture-of-experts MLP: token->expert sort/align, two grouped GEMMs, weighted combine.

The layout follows vLLM's fused_moe. Each token's k (token, expert) pairs are numbered
`pair = token * k + slot`. `align_pairs` sorts the pairs by expert and pads each expert's run to a
multiple of BLOCK_M, so every BLOCK_M-row block of the sorted list belongs to one expert; padding rows
hold the sentinel `num_pairs`. Then, with one program per (block, column tile):

  1. gate_up GEMM with SiLU-and-mul: act[pair] = silu(x[token] @ W_gate[e]^T) * (x[token] @ W_up[e]^T)
  2. down GEMM, weighted: y[pair] = weight[pair] * (act[pair] @ W_down[e]^T)
  3. combine: out[token] = sum over its k slots of y (a torch sum over [T, k, H]).

Everything is shape-static for a given token count (no host sync: the number of padded rows stays on
the device and surplus blocks exit at once), so decode steps run under CUDA graphs.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_pairs,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_ROWS_PER_PAIR_DIV: tl.constexpr,  # a row = pair // this (top_k for x, 1 for act)
    GATED: tl.constexpr,  # B holds [gate; up] (2N rows): store silu(a @ gate^T) * (a @ up^T)
    WEIGHTED: tl.constexpr,  # multiply each row by its pair's routing weight
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)  # [BLOCK_M]; int64: pair * H can pass 2^31
    row_mask = pair < num_pairs
    a_row = pair // A_ROWS_PER_PAIR_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        acc = tl.dot(a, tl.load(b_ptrs, mask=b_mask, other=0.0), acc, input_precision=PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small when experts see few tokens each (decode), so padding stays small."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def align_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, slot) pairs by expert, each expert's run padded to a multiple of block_m.

    expert_ids [T, k] -> (sorted_pairs [max_padded] int32, with `T * k` in padding rows;
    block_expert [max_padded // block_m] int32; num_padded [1] int32, the rows in use), all on the
    device without a host sync."""
    device = expert_ids.device
    flat = expert_ids.flatten()  # [P]
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [E]
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # pairs in expert order
    sorted_expert = flat[order]
    dest = padded_start[sorted_expert] + torch.arange(num_pairs, device=device) - count_start[sorted_expert]
    # at most min(E, P) experts are in use, each padded by under block_m rows
    max_padded = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def _gemm(a, b, c, weights, sorted_pairs, block_expert, num_padded, n, k, rows_div, gated, weighted,
          block_m):
    # untuned: wider column tiles (and more warps for the two accumulators) once blocks are full
    block_n, num_warps = (128, 8) if block_m == 64 else (64, 4)
    block_k = 32 if a.dtype == torch.float32 else 64
    grid = (sorted_pairs.numel() // block_m, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, b, c, weights, sorted_pairs, block_expert, num_padded, n, k, weights.numel(),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROWS_PER_PAIR_DIV=rows_div, GATED=gated, WEIGHTED=weighted,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=3)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              expert_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights, expert_ids [T, k] -> [T, H]."""
    num_tokens, hidden = x.shape
    num_experts, _, inter = down.shape
    top_k = expert_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    weights = weights.to(x.dtype).contiguous()
    block_m = block_m_for(num_tokens * top_k, num_experts)
    sorted_pairs, block_expert, num_padded = align_pairs(expert_ids, num_experts, block_m)
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)  # [P, I]
    _gemm(x, gate_up, act, weights, sorted_pairs, block_expert, num_padded, inter, hidden, top_k,
          True, False, block_m)
    y = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)  # [P, H]
    _gemm(act, down, y, weights, sorted_pairs, block_expert, num_padded, hidden, inter, 1,
          False, True, block_m)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
