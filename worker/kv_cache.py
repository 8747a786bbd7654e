"""The KV cache's element type: the model dtype ("auto"), or FP8 (e4m3) with per-layer scales.

An FP8 cache stores round(x / scale) clamped to e4m3's range (+-448) as torch.float8_e4m3fn and
reads x ~= stored * scale: per tensor, one k_scale and one v_scale per layer. Without calibrated
scales they are 1.0, vLLM's default (no calibration here): within +-448 the cost is e4m3's 3-bit
mantissa, a relative error of at most 2^-4 per element (below 2^-6 an absolute 2^-10); a value
beyond is clamped, which a model with such K or V outliers would need calibrated scales to avoid.
The Triton kernels do the same arithmetic inside (kvmesh.kernels); these are the torch reference's.
"""

import torch

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
DEFAULT_KV_SCALE = 1.0


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for engine argument kv_cache_dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):  # vLLM's names
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got {kv_cache_dtype!r}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale (as x * (1 / scale) in float32, the store kernel's arithmetic), clamped to +-448,
    cast to float8_e4m3fn (rounding to nearest even)."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V in `dtype`: the values themselves when the cache is in the model dtype, or
    float8 values times their scale (computed in float32)."""
    if not is_fp8(cached.dtype):
        return cached
    return (cached.float() * scale).to(dtype)
