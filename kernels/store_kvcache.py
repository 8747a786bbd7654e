"""Write one step's new K/V into the paged pool by slot mapping, in one launch.

Cache layout (see kvmesh.worker.attention.base): [num_blocks, block_size, num_kv_heads, head_dim],
so slot s addresses row s of the cache viewed as [num_blocks * block_size, num_kv_heads * head_dim].
A negative slot (padding in a CUDA-graph batch) is skipped. Into an FP8 (float8_e4m3fn) cache it
stores K * (1 / k_scale) and V * (1 / v_scale), clamped to e4m3's +-448 (the layer's per-tensor
scales; the attention kernels multiply them back in).
"""

import torch
import triton
import triton.language as tl

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@triton.jit
def cache_value(x, inv_scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    """x as the cache holds it: into an FP8 cache, x * (1 / scale) clamped to e4m3's range."""
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    return x.to(dtype)


@triton.jit
def _store_kvcache_kernel(key, value, k_cache, v_cache, slot_mapping, k_inv_scale, v_inv_scale,
                          stride_k_token, stride_v_token, stride_cache_slot,
                          ROW: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key + token * stride_k_token + offs, mask=mask)
    v = tl.load(value + token * stride_v_token + offs, mask=mask)
    dtype = k_cache.dtype.element_ty
    tl.store(k_cache + slot * stride_cache_slot + offs, cache_value(k, k_inv_scale, FP8, FP8_MAX, dtype), mask=mask)
    tl.store(v_cache + slot * stride_cache_slot + offs, cache_value(v, v_inv_scale, FP8, FP8_MAX, dtype), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key, value: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] in key's dtype or
    float8_e4m3fn; slot_mapping: [T]; k_scale, v_scale: an FP8 cache's scales (ignored otherwise)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    # heads and head_dim of one token must be one contiguous row (true for views split off a qkv matmul)
    if key.stride(-1) != 1 or key.stride(-2) != head_dim:
        key = key.contiguous()
    if value.stride(-1) != 1 or value.stride(-2) != head_dim:
        value = value.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert k_cache.shape[2] * k_cache.shape[3] == row, "cache heads/head_dim do not match key"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _store_kvcache_kernel[(num_tokens,)](
        # x * (1 / scale) in float32, as worker/kv_cache.quantize_fp8: the same bytes (Triton's
        # float32 division is approximate)
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), value.stride(0), row,
        ROW=row, BLOCK=triton.next_power_of_2(row), FP8=fp8, FP8_MAX=FP8_E4M3_MAX, num_warps=4)
