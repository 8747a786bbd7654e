"""Paged attention for decode (one new token per sequence), split along the KV length, then merged.

One program per (sequence, KV head, split) reads that split's keys once for all the query heads of
the group (GQA inside the kernel: the group's heads are the rows of one tl.dot, padded to 16).
Splitting the context keeps the GPU busy when there are few sequences with long contexts; a second
small kernel merges the splits by their log-sum-exp. The number of splits is fixed at launch and
each split covers ceil(context / splits) keys computed on the device, so one launch configuration
serves any context length (what a CUDA graph needs).

An FP8 (float8_e4m3fn) cache is read as is and cast to the query's dtype (exact: every e4m3 value
is a bf16 / fp16 value); its per-layer scales are applied outside the dot products, k_scale folded
into the softmax scale and v_scale on the output, which is the same arithmetic as multiplying
every element.
"""

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# Not specialized on the block table's width nor on the number of splits: an eager step's (its own
# width) then runs the kernels a CUDA graph's capture compiled (the model's width), rather than
# compiling others inside a serving run (~1 s on nvidia-h200, 2026-12-03 s22 call 3).
@triton.jit(do_not_specialize=["stride_block_table"])
def _paged_decode_kernel(q_ptr, k_cache, v_cache, out_ptr, part_out, part_lse, seq_lens, block_tables,
                         scale_log2, v_scale,
                         stride_q_token, stride_q_head, stride_o_token, stride_o_head,
                         stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FP8_KV: tl.constexpr,
                         CHUNK: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(seq_lens + seq)
    if CHUNK > 0:  # splits of CHUNK keys: as many as the context needs, the grid's others return
        split_len = CHUNK
        used_splits = tl.cdiv(ctx_len, CHUNK)
        if split >= used_splits:
            return
    else:  # NUM_SPLITS splits of the context, whatever its length
        split_len = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        used_splits = NUM_SPLITS
    start = split * split_len
    end = tl.minimum(ctx_len, start + split_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)  # [BLOCK_G, HEAD_DIM]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table = block_tables + seq * stride_block_table
    kv_base = kv_head * stride_cache_head
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block_ids = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot_off = block_ids * stride_cache_block + (offs_n % PAGE) * stride_cache_slot + kv_base
        k = tl.load(k_cache + slot_off[None, :] + offs_d[:, None], mask=n_mask[None, :], other=0.0)  # [D, N]
        v = tl.load(v_cache + slot_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)  # [N, D]
        if FP8_KV:  # e4m3 -> float32 -> q's dtype: exact (every e4m3 value is a bf16 / fp16 value)
            k = k.to(tl.float32).to(q.dtype)
        if FP8_KV:
            v = v.to(tl.float32).to(q.dtype)
        s = tl.dot(q, k) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if used_splits == 1:  # the whole context: the output itself
        out = acc / l_i[:, None]
        if FP8_KV:
            out = out * v_scale
        tl.store(out_ptr + seq * stride_o_token + heads[:, None] * stride_o_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        empty = l_i == 0.0  # a split past the end of a short context
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        if FP8_KV:  # the merge is a weighted mean of the splits: scaling each scales the result
            out = out * v_scale
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        # [S, H, splits] flattened; the grid's third dimension is the number of splits
        row = (seq * (GROUP * tl.num_programs(1)) + heads) * tl.num_programs(2) + split
        tl.store(part_out + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_mask[:, None])
        tl.store(part_lse + row, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(part_out, part_lse, out_ptr, seq_lens, num_splits, stride_o_token, stride_o_head,
                         NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                         CHUNK: tl.constexpr):
    """Chunk mode (CHUNK > 0): a loop over the context's splits, so one compiled kernel serves every
    grid (num_splits is a runtime value). Else NUM_SPLITS splits at once."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row0 = (seq * tl.num_programs(1) + head) * num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    if CHUNK > 0:
        used_splits = tl.cdiv(tl.load(seq_lens + seq), CHUNK)
        if used_splits == 1:  # the decode kernel wrote this output itself
            return
        m = tl.load(part_lse + row0)  # the first split is never empty
        acc = tl.load(part_out + row0 * HEAD_DIM + offs_d)
        den = tl.math.exp2(m - m)  # 1.0, as the float32 scalar the loop carries
        for split in range(1, used_splits):
            lse = tl.load(part_lse + row0 + split)
            m_new = tl.maximum(m, lse)
            alpha = tl.math.exp2(m - m_new)
            w = tl.math.exp2(lse - m_new)
            acc = acc * alpha + tl.load(part_out + (row0 + split) * HEAD_DIM + offs_d) * w
            den = den * alpha + w
            m = m_new
        out = acc / den
    else:
        offs_s = tl.arange(0, SPLITS_P2)
        s_mask = offs_s < NUM_SPLITS
        lse = tl.load(part_lse + row0 + offs_s, mask=s_mask, other=float("-inf"))
        weight = tl.math.exp2(lse - tl.max(lse, 0))  # empty splits weigh 0
        parts = tl.load(part_out + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None],
                        other=0.0)
        out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_o_token + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty))


# Decode in splits of this many keys (chunk mode), with these tiles: nvidia-h200, 2026-12-03 s22
# (docs/PERF.md "Attention kernels"): ~94% of the copy rate over the KV at batches of 128-256 with
# contexts of 100-2,048 tokens, where flash_attn_with_kvcache reads at 82%.
DEFAULT_CHUNK = "512,64,4,2"


def chunk_config_from_env() -> dict | None:
    """KVMESH_DECODE_CHUNK="chunk[,block_n,num_warps,num_stages]" (default DEFAULT_CHUNK): decodes
    in splits of `chunk` keys on the triton and flash_attn backends; "0": not (the triton backend
    splits by SM count, the flash_attn backend decodes with flash_attn_with_kvcache): None."""
    spec = os.environ.get("KVMESH_DECODE_CHUNK", DEFAULT_CHUNK)
    values = [int(x) for x in spec.split(",")]
    if values[0] == 0:
        return None
    config = dict(zip(("chunk", "block_n", "num_warps", "num_stages"), values))
    if config["chunk"] % config.get("block_n", 64):
        raise ValueError(f"KVMESH_DECODE_CHUNK={spec}: chunk must be a multiple of block_n")
    return config


def chunk_splits(max_seq_len: int, config: dict) -> int:
    """The split grid of chunk mode: enough splits of config["chunk"] keys for the longest context."""
    return triton.cdiv(max_seq_len, config["chunk"])


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough programs for ~2 waves over the SMs, but at least 256 keys per split."""
    if num_seqs * num_kv_heads >= num_sms:
        return 1
    want = triton.cdiv(2 * num_sms, num_seqs * num_kv_heads)
    return max(1, min(want, triton.cdiv(max_seq_len, 256), 64))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, num_splits: int,
                 k_scale: float = 1.0, v_scale: float = 1.0, chunk: int = 0,
                 block_n: int = 64, num_warps: int = 4, num_stages: int = 2) -> None:
    """q, out: [S, H, D] (one token per sequence); caches [num_blocks, page, Hkv, D] in q's dtype or
    float8_e4m3fn (then k_scale / v_scale dequantize them); seq_lens: [S] context lengths including
    the new token (already stored); block_tables: [S, max_blocks].
    chunk 0: each context in num_splits equal splits. chunk > 0 (a multiple of block_n): splits of
    `chunk` keys, as many as each context needs, num_splits at most (cdiv(longest context, chunk)):
    every program reads at most `chunk` keys, however uneven the contexts."""
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert chunk % block_n == 0, (chunk, block_n)
    if num_splits > 1:
        part_out = torch.empty(num_seqs * num_heads * num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs * num_heads * num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    fp8 = k_cache.dtype == torch.float8_e4m3fn  # else the scales are unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables,
        scale * (k_scale if fp8 else 1.0) * LOG2E, float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), PAGE=page, HEAD_DIM=head_dim,
        BLOCK_N=block_n, NUM_SPLITS=0 if chunk else num_splits, FP8_KV=fp8, CHUNK=chunk,
        num_warps=num_warps, num_stages=num_stages)  # chunk mode: one compiled kernel for every grid
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, seq_lens, num_splits, out.stride(0), out.stride(1),
            NUM_SPLITS=0 if chunk else num_splits, SPLITS_P2=1 if chunk else triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, CHUNK=chunk, num_warps=4)
