"""REFERENCE IMPLEMENTATION (tests only) of the two flash-attn 2.8 functions kvmesh calls.

flash-attn is source-only on PyPI and needs CUDA, so CI cannot install it. This module follows its
documented interface (flash_attn/flash_attn_interface.py docstrings and the checks in
csrc/flash_attn/flash_api.cpp) closely enough to catch wrong calls: shapes, dtypes (int32 index
tensors, fp16/bf16 data), the paged layout [num_blocks, page_block_size, nheads_k, headdim] with
page_block_size a multiple of 256, cu_seqlens that count whole contexts, causal masks aligned to the
bottom right, and max_seqlen values that bound the real lengths. It computes in float32 on any
device. The test injects it as `flash_attn` (tests/unit/test_flash_attn_interface.py); on the GPU
machine tests/gpu runs the backend against the real build instead.
"""

import torch

IS_REFERENCE_IMPLEMENTATION = True


def _check_data(name, t):
    if t.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"FlashAttention only support fp16 and bf16 data type ({name} is {t.dtype})")
    if t.stride(-1) != 1:
        raise RuntimeError(f"Input tensor {name} must have contiguous last dimension")


def _check_index(name, t, shape):
    if t.dtype != torch.int32:
        raise RuntimeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise RuntimeError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_paged(k_cache, v_cache, block_table, batch):
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise RuntimeError("paged k_cache / v_cache must be [num_blocks, page_block_size, nheads_k, headdim]")
    if k_cache.shape[1] % 256:
        raise RuntimeError("Paged KV cache block size must be divisible by 256")
    if block_table.dtype != torch.int32:
        raise RuntimeError("block_table must have dtype torch.int32")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.stride(-1) != 1:
        raise RuntimeError(f"block_table must be [batch_size={batch}, max_num_blocks_per_seq], last dim contiguous")


def _attend(q, keys, values, scale, causal):
    """q [sq, H, D]; keys/values [sk, Hkv, D] -> [sq, H, D] float32; causal aligned bottom-right."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if causal:
        sq, sk = q.shape[0], keys.shape[0]
        q_pos = torch.arange(sk - sq, sk, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(sk, device=q.device)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def _gather(cache, block_table_row, length):
    page = cache.shape[1]
    num_blocks = -(-length // page)
    if num_blocks > block_table_row.shape[0]:
        raise RuntimeError("block_table has fewer blocks than the sequence length needs")
    return cache[block_table_row[:num_blocks].long()].reshape(-1, *cache.shape[2:])[:length]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """q: [total_q, nheads, headdim]; k, v: [total_k, nheads_k, headdim], or with block_table
    [num_blocks, page_block_size, nheads_k, headdim]; cu_seqlens_*: [batch + 1] int32."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_data(name, t)
    if dropout_p or softcap or alibi_slopes is not None or tuple(window_size) != (-1, -1):
        raise RuntimeError("this reference covers dropout_p=0, no softcap, no alibi, no local window")
    batch = cu_seqlens_q.shape[0] - 1
    _check_index("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    _check_index("cu_seqlens_k", cu_seqlens_k, (batch + 1,))
    if q.shape[1] % k.shape[-2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if block_table is not None:
        _check_paged(k, v, block_table, batch)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if cq[0] != 0 or ck[0] != 0:
        raise RuntimeError("cu_seqlens must start at 0")
    if cq[-1] != q.shape[0]:
        raise RuntimeError(f"cu_seqlens_q[-1]={cq[-1]} must equal total_q={q.shape[0]}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b in range(batch):
        len_q, len_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if len_q > max_seqlen_q or len_k > max_seqlen_k:
            raise RuntimeError(f"sequence {b}: lengths ({len_q}, {len_k}) exceed max_seqlen ({max_seqlen_q}, {max_seqlen_k})")
        if block_table is not None:
            keys, values = _gather(k, block_table[b], len_k), _gather(v, block_table[b], len_k)
        else:
            keys, values = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        out[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], keys, values, scale, causal).to(q.dtype)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q: [batch, seqlen_q, nheads, headdim]; k_cache, v_cache: [batch_cache, seqlen_cache, nheads_k,
    headdim], or with block_table [num_blocks, page_block_size, nheads_k, headdim];
    cache_seqlens: int or [batch] int32, the context length in the cache."""
    if k is not None or v is not None or rotary_cos is not None or cache_batch_idx is not None or cache_leftpad is not None:
        raise RuntimeError("this reference covers reading the cache only (no k/v append, rotary, batch idx, leftpad)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_data(name, t)
    if q.dim() != 4:
        raise RuntimeError("q must be [batch_size, seqlen_q, num_heads, head_size]")
    batch, seqlen_q = q.shape[:2]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    _check_index("cache_seqlens", cache_seqlens, (batch,))
    if block_table is not None:
        _check_paged(k_cache, v_cache, block_table, batch)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b, length in enumerate(cache_seqlens.tolist()):
        if block_table is not None:
            keys, values = _gather(k_cache, block_table[b], length), _gather(v_cache, block_table[b], length)
        else:
            keys, values = k_cache[b, :length], v_cache[b, :length]
        out[b] = _attend(q[b], keys, values, scale, causal).to(q.dtype)
    return out
