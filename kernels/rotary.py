"""Rotary position embedding (neox / rotate-half layout) for q and k in one launch, optionally with
Qwen3's per-head q / k RMSNorm before it and the step's K / V written into the paged KV cache after it.

Matches kvmesh.worker.layers.rotary: float32 arithmetic with the float32 cos/sin tables
[max_positions, head_dim / 2], result cast back to the input dtype. q, k, v may be strided views
([T, H, D] with a contiguous last dimension, as split off the qkv projection).

- `apply_rotary(positions, q, k, cos, sin)`: new contiguous q and k.
- `apply_qk_norm_rotary(..., q_weight, k_weight, eps, ...)`: each head's row is normed as
  kvmesh.kernels.rms_norm does (the same reduction over the whole row, the same roundings to the input
  dtype) and rotated from that rounded result, so its output equals the separate launches' bit for bit.
- `rotate_and_store(...)`: the same rotation (normed or not); the rotated K and the untouched V go
  straight into the cache rows of `slot_mapping` (a negative slot, CUDA-graph padding, is skipped)
  instead of to new tensors, with the bytes kvmesh.kernels.store_kvcache writes (into an FP8 cache:
  the input-dtype value times 1 / scale, clamped to e4m3's range). One launch instead of two: the
  attention backends then only read the cache (their forward with k = v = None).
"""

import os

import torch
import triton
import triton.language as tl

from kvmesh.kernels.store_kvcache import FP8_E4M3_MAX, cache_value

# Heads per program: each head is the same one-warp row whatever the grouping (the same bits); a
# program walks HEADS heads of one token. One head a program suits decode steps (up to a few hundred
# tokens: 8 made the offline run's decode steps ~90 ms slower, 4 ~40), eight suit prompt chunks (16,384
# tokens: 26 against 59 ms over the run's 252 prefill launches; nvidia-h200, docs/PERF.md). From
# MANY_TOKENS up a launch takes eight; KVMESH_ROTARY_HEADS fixes the number (A/B runs).
MANY_TOKENS = 2048
FIXED_HEADS = int(os.environ.get("KVMESH_ROTARY_HEADS", "0"))


def heads_per_program(num_tokens: int) -> int:
    return FIXED_HEADS or (8 if num_tokens >= MANY_TOKENS else 1)


# From ROWS_FROM tokens up to MANY_TOKENS (decode steps of 64-256 sequences), ROWS heads a program
# as one [ROWS, head_dim] tile over ROWS warps: a 256-token step's 6,144 one-warp programs are more
# than one wave at 32 resident blocks an SM; 1,536 of four warps are one. The same bits as one head
# a program (tests/gpu/test_fused_kernels.py). At 256 tokens 3.3 against 5.1 us a launch, at 64
# 2.2 against 2.3, at 8 1.9 against 1.8 (H100, CUDA-graph replays; docs/PERF.md "What limits it").
# KVMESH_ROTARY_ROWS=0: one head a program at every size (A/B runs).
ROWS = int(os.environ.get("KVMESH_ROTARY_ROWS", "4"))
ROWS_FROM = 64


def rows_per_program(num_tokens: int) -> int:
    """Heads a program as one tile's rows (0: one head a program, heads_per_program's launch)."""
    return ROWS if ROWS_FROM <= num_tokens < MANY_TOKENS else 0


@triton.jit
def _rotary_rows_kernel(q_ptr, k_ptr, v_ptr, q_out, k_out, wq_ptr, wk_ptr, positions, cos_ptr, sin_ptr,
                        k_cache, v_cache, slot_mapping, k_inv_scale, v_inv_scale,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, num_q_heads,
                        num_k_heads, eps, HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                        STORE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, ROWS_: tl.constexpr):
    """Program (token, group of ROWS_ heads): the heads as the rows of one tile, each row what
    _rotate_head does to its head."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * ROWS_ + tl.arange(0, ROWS_)
    valid = heads < num_q_heads + num_k_heads
    is_q = heads < num_q_heads
    kv_head = tl.where(is_q, 0, heads - num_q_heads)
    offs = tl.arange(0, BLOCK)
    cmask = offs < HALF
    mask = valid[:, None] & cmask[None, :]
    pos = tl.load(positions + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * HALF + offs, mask=cmask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + offs, mask=cmask, other=0.0)[None, :]
    src = tl.where(is_q, q_ptr + token * stride_qt + heads * stride_qh,
                   k_ptr + token * stride_kt + kv_head * stride_kh)
    dtype = q_out.dtype.element_ty
    x1 = tl.load(src[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src[:, None] + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        row = tl.arange(0, 2 * BLOCK)
        whole = tl.load(src[:, None] + row[None, :], mask=valid[:, None] & (row < 2 * HALF)[None, :],
                        other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(whole * whole, 1) / (2 * HALF) + eps)[:, None]
        w = tl.where(is_q, wq_ptr, wk_ptr)
        w1 = tl.load(w[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w[:, None] + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    qmask = mask & is_q[:, None]
    qdst = q_out + (token * num_q_heads + tl.where(is_q, heads, 0)) * 2 * HALF
    tl.store(qdst[:, None] + offs[None, :], y1, mask=qmask)
    tl.store(qdst[:, None] + HALF + offs[None, :], y2, mask=qmask)
    kmask = mask & (heads >= num_q_heads)[:, None]
    if STORE:
        slot = tl.load(slot_mapping + token + tl.zeros([ROWS_], tl.int32))  # the token's, per row
        kmask = kmask & (slot >= 0)[:, None]  # a negative slot is CUDA-graph padding
        at = slot.to(tl.int64) * num_k_heads * 2 * HALF + kv_head * 2 * HALF
        vsrc = v_ptr + token * stride_vt + kv_head * stride_vh
        v1 = tl.load(vsrc[:, None] + offs[None, :], mask=kmask, other=0.0)
        v2 = tl.load(vsrc[:, None] + HALF + offs[None, :], mask=kmask, other=0.0)
        cdt = k_cache.dtype.element_ty
        tl.store(k_cache + at[:, None] + offs[None, :], cache_value(y1, k_inv_scale, FP8, FP8_MAX, cdt), mask=kmask)
        tl.store(k_cache + at[:, None] + HALF + offs[None, :], cache_value(y2, k_inv_scale, FP8, FP8_MAX, cdt),
                 mask=kmask)
        tl.store(v_cache + at[:, None] + offs[None, :], cache_value(v1, v_inv_scale, FP8, FP8_MAX, cdt), mask=kmask)
        tl.store(v_cache + at[:, None] + HALF + offs[None, :], cache_value(v2, v_inv_scale, FP8, FP8_MAX, cdt),
                 mask=kmask)
    else:
        kdst = k_out + (token * num_k_heads + kv_head) * 2 * HALF
        tl.store(kdst[:, None] + offs[None, :], y1, mask=kmask)
        tl.store(kdst[:, None] + HALF + offs[None, :], y2, mask=kmask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, v_ptr, q_out, k_out, wq_ptr, wk_ptr, positions, cos_ptr, sin_ptr,
                   k_cache, v_cache, slot_mapping, k_inv_scale, v_inv_scale,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, num_q_heads, num_k_heads,
                   eps, HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr,
                   FP8: tl.constexpr, FP8_MAX: tl.constexpr, HEADS: tl.constexpr):
    """Program (token, group of HEADS heads, q heads first then k heads): each head as one row."""
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(positions + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * HALF + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + offs, mask=mask, other=0.0)
    for h in tl.static_range(HEADS):
        head = tl.program_id(1) * HEADS + h
        if head < num_q_heads + num_k_heads:
            _rotate_head(q_ptr, k_ptr, v_ptr, q_out, k_out, wq_ptr, wk_ptr, cos, sin, k_cache, v_cache,
                         slot_mapping, k_inv_scale, v_inv_scale, stride_qt, stride_qh, stride_kt, stride_kh,
                         stride_vt, stride_vh, num_q_heads, num_k_heads, eps, token, head, offs, mask,
                         HALF, BLOCK, NORM, STORE, FP8, FP8_MAX)


@triton.jit
def _rotate_head(q_ptr, k_ptr, v_ptr, q_out, k_out, wq_ptr, wk_ptr, cos, sin, k_cache, v_cache, slot_mapping,
                 k_inv_scale, v_inv_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 num_q_heads, num_k_heads, eps, token, head, offs, mask, HALF: tl.constexpr, BLOCK: tl.constexpr,
                 NORM: tl.constexpr, STORE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    is_q = head < num_q_heads
    kv_head = head - num_q_heads
    if is_q:
        src = q_ptr + token * stride_qt + head * stride_qh
        w_ptr = wq_ptr
    else:
        src = k_ptr + token * stride_kt + kv_head * stride_kh
        w_ptr = wk_ptr
    dtype = q_out.dtype.element_ty
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # the norm's reduction over the whole row at once, as rms_norm's kernel (the same float32 sum)
        row = tl.arange(0, 2 * BLOCK)
        whole = tl.load(src + row, mask=row < 2 * HALF, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(whole * whole, 0) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)  # the norm's output
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    if is_q:
        dst = q_out + (token * num_q_heads + head) * 2 * HALF
        tl.store(dst + offs, y1, mask=mask)
        tl.store(dst + HALF + offs, y2, mask=mask)
    elif STORE:
        slot = tl.load(slot_mapping + token)
        if slot >= 0:  # a negative slot is CUDA-graph padding
            at = slot.to(tl.int64) * num_k_heads * 2 * HALF + kv_head * 2 * HALF  # this head's cache row
            vsrc = v_ptr + token * stride_vt + kv_head * stride_vh
            v1 = tl.load(vsrc + offs, mask=mask, other=0.0)
            v2 = tl.load(vsrc + HALF + offs, mask=mask, other=0.0)
            cdt = k_cache.dtype.element_ty  # store_kvcache's bytes (cache_value)
            tl.store(k_cache + at + offs, cache_value(y1, k_inv_scale, FP8, FP8_MAX, cdt), mask=mask)
            tl.store(k_cache + at + HALF + offs, cache_value(y2, k_inv_scale, FP8, FP8_MAX, cdt), mask=mask)
            tl.store(v_cache + at + offs, cache_value(v1, v_inv_scale, FP8, FP8_MAX, cdt), mask=mask)
            tl.store(v_cache + at + HALF + offs, cache_value(v2, v_inv_scale, FP8, FP8_MAX, cdt), mask=mask)
    else:
        dst = k_out + (token * num_k_heads + kv_head) * 2 * HALF
        tl.store(dst + offs, y1, mask=mask)
        tl.store(dst + HALF + offs, y2, mask=mask)


def _launch(positions, q, k, cos, sin, norm=None, store=None, heads=None, rows=None):
    """norm: (q_weight, k_weight, eps) or None; store: (v, k_cache, v_cache, slot_mapping, k_scale,
    v_scale) or None; heads: heads per program (None: heads_per_program); rows: heads a program as
    one tile (None: rows_per_program; 0: not; a given `heads` takes precedence). Returns (q_out, k_out),
    k_out None when K went into the cache."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = None if store else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_weight, k_weight, eps = norm if norm else (q, q, 0.0)  # unread without NORM
    if store:
        v, k_cache, v_cache, slot_mapping, k_scale, v_scale = store
        if v.stride(-1) != 1:
            v = v.contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
        assert tuple(k_cache.shape[2:]) == (num_k_heads, head_dim), "cache heads/head_dim do not match k"
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        # x * (1 / scale) in float32, as store_kvcache (Triton's float32 division is approximate)
        k_inv, v_inv = 1.0 / k_scale, 1.0 / v_scale
    else:
        v, k_cache, v_cache, slot_mapping, fp8, k_inv, v_inv = k, q, q, positions, False, 1.0, 1.0
    if not num_tokens:
        return q_out, k_out
    half, all_heads = head_dim // 2, num_q_heads + num_k_heads
    args = (q, k, v, q_out, k_out if k_out is not None else q_out, q_weight, k_weight, positions, cos, sin,
            k_cache, v_cache, slot_mapping, k_inv, v_inv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            num_q_heads, num_k_heads, eps)
    consts = dict(HALF=half, BLOCK=triton.next_power_of_2(half), NORM=norm is not None,
                  STORE=store is not None, FP8=fp8, FP8_MAX=FP8_E4M3_MAX)
    rows = rows_per_program(num_tokens) if rows is None else rows
    if rows and heads is None:
        _rotary_rows_kernel[(num_tokens, triton.cdiv(all_heads, rows))](*args, **consts, ROWS_=rows,
                                                                         num_warps=rows)
    else:
        heads = min(heads or heads_per_program(num_tokens), all_heads)
        _rotary_kernel[(num_tokens, triton.cdiv(all_heads, heads))](*args, **consts, HEADS=heads, num_warps=1)
    return q_out, k_out


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, H, D], k [T, Hkv, D]; cos, sin [max_positions, D / 2] float32 contiguous."""
    return _launch(positions, q, k, cos, sin)


def apply_qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                         k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary(rms_norm(q, q_weight), rms_norm(k, k_weight)) in one launch; weights [D] of q's dtype,
    the rest as apply_rotary's."""
    return _launch(positions, q, k, cos, sin, norm=(q_weight, k_weight, eps))


def rotate_and_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                     norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """The rotated q [T, H, D]; rotated k and v ([T, Hkv, D]) written into k_cache / v_cache
    ([num_blocks, block_size, Hkv, D], q's dtype or float8_e4m3fn) at slot_mapping [T], as
    store_kvcache(rotated k, v, ...) would. norm: (q_weight, k_weight, eps) for Qwen3's q / k norms."""
    return _launch(positions, q, k, cos, sin, norm=norm,
                   store=(v, k_cache, v_cache, slot_mapping, k_scale, v_scale))[0]
