"""Dynamic FP8 (e4m3) quantization of activations with one scale per row (token), in one launch:
each program reads its row, takes the row's amax, writes scale = max(amax * (1 / 448), MIN_SCALE)
and the row divided by it (IEEE division), clamped to +-448, as float8_e4m3fn (round to nearest
even on the GPU): the bytes of the torch form in worker/layers/fp8.quantize_per_token, which takes
~7 launches per linear layer (paid on the host by the eager prefill)."""

import torch
import triton
import triton.language as tl

from kvmesh.kernels.store_kvcache import FP8_E4M3_MAX
MAX_BLOCK = 8192  # a longer row is read in blocks of this many, twice (amax, then quantize)


@triton.jit
def _quantize_rows_kernel(x, q, scale_out, num_cols, stride_x, stride_q,
                          FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_cols, BLOCK):
        mask = start + offs < num_cols
        v = tl.load(x + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) * INV_FP8_MAX, MIN_SCALE)
    tl.store(scale_out + row, scale)
    for start in range(0, num_cols, BLOCK):
        mask = start + offs < num_cols
        v = tl.load(x + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.div_rn(v, scale), -FP8_MAX), FP8_MAX)
        tl.store(q + row * stride_q + start + offs, v.to(q.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] with unit stride along K -> (x as float8_e4m3fn [M, K] contiguous, float32 scales
    [M, 1]): x[i] ~= q[i] * scale[i]."""
    assert x.dim() == 2 and x.stride(-1) == 1, "rows must be contiguous"
    num_rows, num_cols = x.shape
    q = torch.empty((num_rows, num_cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows:
        block = min(triton.next_power_of_2(num_cols), MAX_BLOCK)
        _quantize_rows_kernel[(num_rows,)](x, q, scale, num_cols, x.stride(0), q.stride(0),
                                           FP8_MAX=FP8_E4M3_MAX, INV_FP8_MAX=1.0 / FP8_E4M3_MAX,
                                           MIN_SCALE=min_scale, BLOCK=block,
                                           num_warps=4 if block <= 2048 else 8)
    return q, scale
