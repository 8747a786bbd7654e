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

Tiles (`config_for`) are by the number of rows; `bench/gpu_kernels.py --norm-gemm` times them
against the three kernels they replace. The decoder uses this kernel only for steps of at most
KVMESH_NORM_GEMM_MAX_TOKENS rows (worker/layers/kernels.py; 0, the default: never).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, w, acc, WIDEN: tl.constexpr):
    if WIDEN:  # float32 operands, exact products (ieee: no TF32 rounding)
        return tl.dot(a, w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, w, acc)


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
    offs_k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    x_rows = rows.to(tl.int64)[:, None] * K
    w_cols = cols.to(tl.int64)[None, :] * K  # W is [N (2N with SILU), K], K contiguous
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        a_mask = row_mask[:, None] & k_mask[None, :]
        total = tl.load(x_ptr + x_rows + ks[None, :], mask=a_mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + x_rows + ks[None, :], mask=a_mask, other=0.0)
            total = (total.to(tl.float32) + r.to(tl.float32)).to(dtype)
            if pid_n == 0:
                tl.store(total_ptr + x_rows + ks[None, :], total, mask=a_mask)
        t = total.to(tl.float32)
        squares += tl.sum(t * t, axis=1)
        nw = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = (t * nw[None, :]).to(dtype)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_ptr + w_cols + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        if WIDEN:
            a = a.to(tl.float32)
        acc = _dot(a, w, acc, WIDEN)
        if SILU:
            w_up = tl.load(w_ptr + N * K + w_cols + ks[:, None], mask=w_mask, other=0.0)
            acc_up = _dot(a, w_up, acc_up, WIDEN)
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


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the most rows a tile set serves; a first
# guess from the tiles cuBLAS picks at these shapes (PERF.md's profile: 64 x 16-64 below 64 rows,
# 128 x 64 above), to be replaced by what `bench/gpu_kernels.py --norm-gemm` measures fastest
CONFIGS = ((16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
           (128, 128, 64, 8, 3))
CONFIG_ROWS = (16, 32, 64, 128, 1 << 31)


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
    assert x.dim() == 2 and x.is_contiguous() and weight.is_contiguous(), "contiguous rows"
    rows, k = x.shape
    assert weight.shape[1] == k and norm_weight.shape == (k,), "shapes"
    assert weight.dtype == norm_weight.dtype == x.dtype, "one dtype"
    # WIDEN: the MMA's operands in float32, for float32 inputs and on the CPU (Triton's interpreter,
    # whose bf16 dot multiplies the raw bits); bf16 products are exact in float32, so only the order
    # of the sums can differ from the GPU's bf16 MMA with its float32 accumulator
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty_like(x)
    if rows:
        block_m, block_n, block_k, warps, stages = config or config_for(rows)
        grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
        _norm_gemm_kernel[grid](x, residual if residual is not None else x, norm_weight, weight,
                                bias if bias is not None else weight, out, total, rows, n, eps,
                                K=k, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
                                SILU=silu, WIDEN=x.dtype == torch.float32 or not x.is_cuda,
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                num_warps=warps, num_stages=stages)
    return out, total
