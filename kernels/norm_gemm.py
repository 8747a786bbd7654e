"""A decoder layer's RMSNorm (with its residual add) and the GEMM it feeds, in one launch: the norm
before qkv_proj, and the norm before gate_up_proj with SiLU-and-mul on the GEMM's output.

Unfused, a decode layer runs add + RMSNorm, the qkv GEMM, ..., add + RMSNorm, the gate_up GEMM, and
SiLU-and-mul: three launches of ~2 us each (PERF.md, "What limits it") beside GEMMs that small-M
batches leave bound by each launch's fill and drain rather than by their bytes. Here each program
computes a [BLOCK_M, BLOCK_N] tile of the output and reads its rows of x (and of the residual) once,
across K, as the GEMM's A operand:

    total = x + residual              rounded to x's dtype, as torch's add and add_rms_norm; written
                                      back (the new residual stream) by the programs of column tile 0
    a     = total * norm_weight       rounded to the dtype: the MMA's A operand
    out   = rstd * (a @ W^T) (+ bias) rstd = rsqrt(mean(total^2) + eps) of each row, summed as the K
                                      loop goes, applied after it: one pass over the row

The unfused path rounds total * rstd before the weight multiplies it; here rstd comes after the
product, so the output differs from it by the rounding of one bf16 operand and the order of the
sums (the bf16 band of any other GEMM), not bit for bit. With `silu`, W is [gate; up] (2I rows, as
the fused gate_up_proj and its tensor-parallel shards hold it) and the program keeps both tiles:
out = silu(gate) * up, rounded as kvmesh.kernels.silu_and_mul rounds them.

`norm_qkv_rotate_store` goes on from the qkv GEMM to what kvmesh.kernels.rotary.rotate_and_store
does: a program holds one head of the output as two half-head accumulators, so Qwen3's head norm,
the rotation (rotate-half) and the K / V store into the paged cache run in its epilogue.

Tiles (`config_for`) are by the number of rows; `bench/gpu_kernels.py --norm-gemm` times them
against the launches they replace. The decoder uses these kernels only for steps of at most
KVMESH_NORM_GEMM_MAX_TOKENS rows (worker/layers/kernels.py; 0, the default: never), the rotation
form unless KVMESH_NORM_GEMM_ROTATE=0.
"""

import torch
import triton
import triton.language as tl

from kvmesh.kernels.store_kvcache import FP8_E4M3_MAX, cache_value


@triton.jit
def _dot(a, w, acc, WIDEN: tl.constexpr):
    if WIDEN:  # float32 operands, exact products (ieee: no TF32 rounding)
        return tl.dot(a, w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _norm_dot(x_ptr, res_ptr, norm_w_ptr, total_ptr, w_ptr, w_rows, w_rows2, w_mask, rows, row_mask,
              write_total, K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, TWO: tl.constexpr,
              WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop shared by the kernels: (a @ W[w_rows]^T, a @ W[w_rows2]^T if TWO, sum of total^2)
    for the program's rows, a = (x + residual) * norm_weight rounded to the dtype; the sum
    x + residual written to total_ptr where write_total."""
    offs_k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    x_rows = rows.to(tl.int64)[:, None] * K
    w_at = w_rows.to(tl.int64)[None, :] * K  # W is [rows, K], K contiguous
    w_at2 = w_rows2.to(tl.int64)[None, :] * K
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        a_mask = row_mask[:, None] & k_mask[None, :]
        total = tl.load(x_ptr + x_rows + ks[None, :], mask=a_mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + x_rows + ks[None, :], mask=a_mask, other=0.0)
            total = (total.to(tl.float32) + r.to(tl.float32)).to(dtype)
            if write_total:
                tl.store(total_ptr + x_rows + ks[None, :], total, mask=a_mask)
        t = total.to(tl.float32)
        squares += tl.sum(t * t, axis=1)
        nw = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = (t * nw[None, :]).to(dtype)
        if WIDEN:
            a = a.to(tl.float32)
        tile_mask = k_mask[:, None] & w_mask[None, :]
        acc = _dot(a, tl.load(w_ptr + w_at + ks[:, None], mask=tile_mask, other=0.0), acc, WIDEN)
        if TWO:
            acc2 = _dot(a, tl.load(w_ptr + w_at2 + ks[:, None], mask=tile_mask, other=0.0), acc2, WIDEN)
    return acc, acc2, squares


@triton.jit
def _norm_gemm_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, total_ptr,
                      M, N, eps,
                      K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SILU: tl.constexpr, WIDEN: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # the row tiles that share a weight tile run side by side (program id 0 varies fastest), so the
    # weight comes from HBM once and from L2 for the others
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    dtype = x_ptr.dtype.element_ty
    # with SILU, W is [gate; up]: the up rows N below the gate rows
    acc, acc_up, squares = _norm_dot(x_ptr, res_ptr, norm_w_ptr, total_ptr, w_ptr, cols, N + cols, col_mask,
                                     rows, row_mask, pid_n == 0, K, HAS_RESIDUAL, SILU, WIDEN,
                                     BLOCK_M, BLOCK_N, BLOCK_K)
    rstd = tl.math.rsqrt(squares / K + eps)[:, None]
    out = acc * rstd
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        # as the unfused path: the GEMM's outputs rounded, silu in float32 rounded, the product rounded
        gate = out.to(dtype).to(tl.float32)
        up = (acc_up * rstd).to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = act * up
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], out.to(dtype), mask=out_mask)


@triton.jit
def _norm_qkv_rotate_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, q_out, total_ptr,
                            wq_ptr, wk_ptr, positions, cos_ptr, sin_ptr, k_cache, v_cache, slot_mapping,
                            k_inv_scale, v_inv_scale, M, num_q_heads, num_kv_heads, eps, head_eps,
                            K: tl.constexpr, HALF: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                            HAS_BIAS: tl.constexpr, HEAD_NORM: tl.constexpr, FP8: tl.constexpr,
                            FP8_MAX: tl.constexpr, WIDEN: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row tile, head of the qkv output: q heads, then k, then v): the head's two halves as
    two accumulators, so the rotation (rotate-half) is elementwise in the epilogue."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    half = tl.arange(0, HALF)
    cols = head * 2 * HALF + half
    dtype = x_ptr.dtype.element_ty
    acc1, acc2, squares = _norm_dot(x_ptr, res_ptr, norm_w_ptr, total_ptr, w_ptr, cols, cols + HALF,
                                    half < HALF, rows, row_mask, head == 0, K, HAS_RESIDUAL, True, WIDEN,
                                    BLOCK_M, HALF, BLOCK_K)
    rstd = tl.math.rsqrt(squares / K + eps)[:, None]
    y1 = acc1 * rstd
    y2 = acc2 * rstd
    if HAS_BIAS:
        y1 += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        y2 += tl.load(bias_ptr + cols + HALF).to(tl.float32)[None, :]
    x1 = y1.to(dtype).to(tl.float32)  # the projection's output, as the unfused path rounds it
    x2 = y2.to(dtype).to(tl.float32)
    mask = row_mask[:, None]
    kv_head = head - num_q_heads
    # K / V go to the cache row of each token's slot; a negative slot is CUDA-graph padding
    slot = tl.load(slot_mapping + rows, mask=row_mask, other=-1).to(tl.int64)
    cache_at = (slot * num_kv_heads * 2 * HALF)[:, None] + half[None, :]  # + the KV head's offset
    stored = mask & (slot >= 0)[:, None]
    if head < num_q_heads + num_kv_heads:  # q or k: Qwen3's head norm, then the rotation
        if HEAD_NORM:  # as kvmesh.kernels.rotary: normed, rounded, weighted, rounded
            if head < num_q_heads:
                w1 = tl.load(wq_ptr + half).to(tl.float32)[None, :]
                w2 = tl.load(wq_ptr + HALF + half).to(tl.float32)[None, :]
            else:
                w1 = tl.load(wk_ptr + half).to(tl.float32)[None, :]
                w2 = tl.load(wk_ptr + HALF + half).to(tl.float32)[None, :]
            hr = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + head_eps)[:, None]
            x1 = ((x1 * hr).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * hr).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        pos = tl.load(positions + rows, mask=row_mask, other=0).to(tl.int64)[:, None] * HALF + half[None, :]
        cos = tl.load(cos_ptr + pos, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + pos, mask=mask, other=0.0)
        r1 = (x1 * cos - x2 * sin).to(dtype)
        r2 = (x2 * cos + x1 * sin).to(dtype)
        if head < num_q_heads:
            at = (rows.to(tl.int64) * num_q_heads + head)[:, None] * 2 * HALF + half[None, :]
            tl.store(q_out + at, r1, mask=mask)
            tl.store(q_out + at + HALF, r2, mask=mask)
        else:
            at = cache_at + kv_head * 2 * HALF
            cdt = k_cache.dtype.element_ty
            tl.store(k_cache + at, cache_value(r1, k_inv_scale, FP8, FP8_MAX, cdt), mask=stored)
            tl.store(k_cache + at + HALF, cache_value(r2, k_inv_scale, FP8, FP8_MAX, cdt), mask=stored)
    else:
        at = cache_at + (kv_head - num_kv_heads) * 2 * HALF
        cdt = v_cache.dtype.element_ty
        tl.store(v_cache + at, cache_value(x1.to(dtype), v_inv_scale, FP8, FP8_MAX, cdt), mask=stored)
        tl.store(v_cache + at + HALF, cache_value(x2.to(dtype), v_inv_scale, FP8, FP8_MAX, cdt), mask=stored)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the most rows a tile set serves: tiles whose
# qkv, gate_up and rotation forms compile for sm_90 without spilling registers (Triton 3.9's compile
# for an H100/H200 target, on the CPU: tests/unit/test_norm_gemm_sm90.py). Wider K steps at 4 warps
# spill from 32 rows up (the A operand's add, square and weight are BLOCK_M x BLOCK_K in registers),
# hence 8 warps from 64 rows. To be replaced by what `bench/gpu_kernels.py --norm-gemm` measures
# fastest on the GPU.
CONFIGS = ((16, 64, 128, 4, 4), (32, 64, 64, 4, 4), (64, 64, 64, 8, 4), (64, 128, 64, 8, 3),
           (128, 64, 64, 8, 3))
CONFIG_ROWS = (16, 32, 64, 128, 1 << 31)
# the tiles `bench/gpu_kernels.py --norm-gemm` sweeps: none of them spills in that compile
SWEEP = ((16, 32, 64, 4, 4), (16, 64, 64, 4, 4), (16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (32, 32, 64, 4, 4),
         (32, 64, 64, 4, 4), (64, 32, 64, 4, 4), (64, 64, 32, 8, 4), (64, 64, 64, 8, 4), (64, 128, 32, 8, 4),
         (64, 128, 64, 8, 3), (128, 64, 32, 8, 4), (128, 64, 64, 8, 3), (128, 128, 32, 8, 3))


def config_for(rows: int) -> tuple[int, int, int, int, int]:
    for limit, config in zip(CONFIG_ROWS, CONFIGS):
        if rows <= limit:
            return config
    raise AssertionError("unreachable")


def norm_gemm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, silu: bool = False,
              config: tuple[int, int, int, int, int] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight^T (+ bias), then silu(gate) * up if `silu`; x + residual),
    for contiguous [M, K] x and residual (None: x is the stream, as a decoder's first layer) of one
    dtype, norm_weight [K] and weight [N, K] (with `silu` [2 I, K], giving [M, I]) of that dtype."""
    _check_operands(x, residual, norm_weight, weight)
    rows, k = x.shape
    assert not (silu and bias is not None), "gate_up has no bias"
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty_like(x)
    if rows:
        block_m, block_n, block_k, warps, stages = config or config_for(rows)
        grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
        _norm_gemm_kernel[grid](x, residual if residual is not None else x, norm_weight, weight,
                                bias if bias is not None else weight, out, total, rows, n, eps,
                                K=k, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
                                SILU=silu, WIDEN=_widen(x),
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                num_warps=warps, num_stages=stages)
    return out, total


def _check_operands(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    weight: torch.Tensor) -> None:
    assert x.dim() == 2 and x.is_contiguous() and weight.is_contiguous(), "contiguous rows"
    assert weight.shape[1] == x.shape[1] and norm_weight.shape == (x.shape[1],), "shapes"
    assert weight.dtype == norm_weight.dtype == x.dtype, "one dtype"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()


def _widen(x: torch.Tensor) -> bool:
    """The MMA's operands in float32: for float32 inputs, and on the CPU (Triton's interpreter, whose
    bf16 dot multiplies the raw bits); bf16 products are exact in float32, so only the order of the
    sums can differ from the GPU's bf16 MMA with its float32 accumulator."""
    return x.dtype == torch.float32 or not x.is_cuda


def fits_rotation(head_dim: int, x: torch.Tensor) -> bool:
    """Whether norm_qkv_rotate_store takes heads of head_dim (a half head is a tile's width)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half & (half - 1) == 0 and half >= (16 if x.is_cuda else 1)


def norm_qkv_rotate_store(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                          eps: float, weight: torch.Tensor, bias: torch.Tensor | None, num_q_heads: int,
                          num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: float = 1.0, v_scale: float = 1.0,
                          head_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                          config: tuple[int, int, int, int, int] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer up to its attention in one launch: norm_gemm's add + RMSNorm + qkv projection
    (weight [(H + 2 Hkv) D, K]), then what kvmesh.kernels.rotary.rotate_and_store does with its
    output: Qwen3's q / k head norms (head_norm: (q_weight, k_weight, eps)), the rotation (cos, sin
    [max_positions, D / 2] float32), K and V into the paged caches at slot_mapping. Returns (the
    rotated q [M, H, D], x + residual). A program computes one head of a row tile; config's BLOCK_M,
    BLOCK_K, warps and stages are used, its BLOCK_N is the half head."""
    _check_operands(x, residual, norm_weight, weight)
    rows, k = x.shape
    heads = num_q_heads + 2 * num_kv_heads
    head_dim = weight.shape[0] // heads
    half = head_dim // 2
    assert weight.shape[0] == heads * head_dim, "shapes"
    assert fits_rotation(head_dim, x), "head_dim / 2 must be a power of two (on a GPU at least 16: tl.dot's least N)"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim), "cache heads / head_dim"
    q = torch.empty(rows, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty_like(x)
    if rows:
        block_m, _, block_k, warps, stages = config or config_for(rows)
        wq, wk, head_eps = head_norm if head_norm else (norm_weight, norm_weight, 0.0)  # unread without
        _norm_qkv_rotate_kernel[(triton.cdiv(rows, block_m), heads)](
            x, residual if residual is not None else x, norm_weight, weight,
            bias if bias is not None else weight, q, total, wq, wk, positions, cos, sin, k_cache, v_cache,
            slot_mapping, 1.0 / k_scale, 1.0 / v_scale, rows, num_q_heads, num_kv_heads, eps, head_eps,
            K=k, HALF=half, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            HEAD_NORM=head_norm is not None, FP8=k_cache.dtype == torch.float8_e4m3fn, FP8_MAX=FP8_E4M3_MAX,
            WIDEN=_widen(x), BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return q, total
