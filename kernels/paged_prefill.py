"""Paged attention for prompt chunks: varlen queries, causal, K/V read through the block table.

Each sequence's new tokens sit at the end of its context (the cached or previously computed
prefix comes first), so query i of a sequence with context C and Q new tokens is at position
C - Q + i and sees keys 0..C - Q + i. The step's new K/V must already be in the cache
(store_kvcache runs first), so one code path covers fresh prompts, chunks and prefix-cache hits.
GQA: each program reads its query head's KV head directly (no expanded copy of K/V).
An FP8 cache is cast to the query's dtype as it is read, with k_scale folded into the softmax scale
and v_scale applied to the output (as in paged_decode).
"""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# Not specialized on the block table's width nor on the first sequence (a step's prompts follow its
# decodes: the tables are passed whole, with their offset, so no pointer's alignment varies either):
# one compiled form serves every step, and an engine's start-up compiles it (ModelRunner.
# warm_up_prompt_steps), not a serving run's first long prompt (~0.3 s a form on nvidia-h200).
@triton.jit(do_not_specialize=["stride_block_table", "first_seq"])
def _paged_prefill_kernel(q_ptr, k_cache, v_cache, out_ptr, query_start_loc, seq_lens, block_tables,
                          scale_log2, v_scale,
                          stride_q_token, stride_q_head, stride_o_token, stride_o_head,
                          stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table,
                          first_seq,
                          GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8_KV: tl.constexpr):
    m_block = tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(seq_lens + seq)
    prefix_len = ctx_len - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    q_pos = prefix_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables + seq * stride_block_table
    kv_base = kv_head * stride_cache_head
    # keys past the last query of this tile are masked for every row: stop there
    kv_end = tl.minimum(ctx_len, prefix_len + (m_block + 1) * BLOCK_M)
    # tiles entirely below the first query of this tile need no causal mask
    full_end = ((prefix_len + m_block * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        block_ids = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot_off = block_ids * stride_cache_block + (offs_n % PAGE) * stride_cache_slot + kv_base
        k = tl.load(k_cache + slot_off[None, :] + offs_d[:, None], mask=n_mask[None, :], other=0.0)  # [D, N]
        if FP8_KV:  # e4m3 -> float32 -> q's dtype: exact (every e4m3 value is a bf16 / fp16 value)
            k = k.to(tl.float32).to(q.dtype)
        s = tl.dot(q, k) * scale_log2  # [BLOCK_M, BLOCK_N], log2 units
        if start + BLOCK_N > full_end:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + slot_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)  # [N, D]
        if FP8_KV:
            v = v.to(tl.float32).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    if FP8_KV:
        out = out * v_scale
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_o_token + head * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  max_query_len: int, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                  first_seq: int = 0) -> None:
    """q, out: [T, H, D] (the rows named by query_start_loc); caches [num_blocks, page, Hkv, D] in
    q's dtype or float8_e4m3fn (dequantized by k_scale / v_scale);
    query_start_loc: [S + 1] int32 (absolute rows of q); seq_lens: [S]; block_tables: [S, max_blocks].
    Sequences `first_seq` to S - 1 are computed (a step's prompts after its decodes)."""
    num_seqs = seq_lens.shape[0] - first_seq
    if num_seqs == 0 or max_query_len == 0:
        return
    _, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    block_m = 64 if max_query_len > 32 else 16
    block_n = 64
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    fp8 = k_cache.dtype == torch.float8_e4m3fn  # else the scales are unused
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        scale * (k_scale if fp8 else 1.0) * LOG2E, float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), first_seq,
        GROUP=num_heads // num_kv_heads, PAGE=page, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, FP8_KV=fp8, num_warps=4, num_stages=2)
