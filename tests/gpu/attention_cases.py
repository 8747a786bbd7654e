"""Random paged-attention problems and a float32 reference, shared by the backend tests.

A case is a flat step: `num_decodes` sequences with one new token, then prompt chunks of
`prompt_lens` new tokens after `prefix_lens` tokens already in the cache. Block ids are a random
permutation of the pool, so a kernel that ignores the block table cannot pass.
"""

import dataclasses
from dataclasses import dataclass

import torch

from kvmesh.worker.attention.base import AttentionMetadata
from kvmesh.worker.kv_cache import dequantize, quantize_fp8


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D] new keys of this step
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, page, Hkv, D], prefix already filled, new slots poisoned
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float


def make_case(*, num_heads: int, num_kv_heads: int, head_dim: int, page: int,
              decode_ctx: list[int], prompt_lens: list[int], prefix_lens: list[int],
              dtype=torch.bfloat16, device="cuda", seed: int = 0) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    query_lens = [1] * len(decode_ctx) + list(prompt_lens)
    seq_lens = list(decode_ctx) + [p + q for p, q in zip(prefix_lens, prompt_lens)]
    blocks_per_seq = [-(-s // page) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slot_mapping, used = [], 0
    for i, (n, s, ql) in enumerate(zip(blocks_per_seq, seq_lens, query_lens)):
        ids = perm[used:used + n]
        used += n
        block_tables[i, :n] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(s - ql, s):
            slot_mapping.append(ids[pos // page] * page + pos % page)
    total = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    k_cache = randn(num_blocks, page, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, page, num_kv_heads, head_dim)
    slots = torch.tensor(slot_mapping, dtype=torch.int64)
    # the slots this step writes hold garbage until the backend stores k, v there
    k_cache.view(-1, num_kv_heads, head_dim)[slots.to(device)] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[slots.to(device)] = float("nan")
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=block_tables.to(device), slot_mapping=slots.to(device),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), num_decode_tokens=len(decode_ctx))
    return Case(q=randn(total, num_heads, head_dim), k=randn(total, num_kv_heads, head_dim),
                v=randn(total, num_kv_heads, head_dim), k_cache=k_cache, v_cache=v_cache,
                metadata=metadata, scale=head_dim ** -0.5)


def reference_attention(case: Case) -> torch.Tensor:
    """Float32 causal attention over each sequence's whole context, gathered through the block table."""
    md = case.metadata
    num_heads, num_kv_heads = case.q.shape[1], case.k.shape[1]
    page = case.k_cache.shape[1]
    k_cache = case.k_cache.float().clone()
    v_cache = case.v_cache.float().clone()
    flat_k = k_cache.view(-1, num_kv_heads, k_cache.shape[-1])
    flat_v = v_cache.view(-1, num_kv_heads, v_cache.shape[-1])
    flat_k[md.slot_mapping] = case.k.float()
    flat_v[md.slot_mapping] = case.v.float()
    out = torch.empty(case.q.shape, dtype=torch.float32, device=case.q.device)
    qsl = md.query_start_loc.tolist()
    for i, (ql, sl) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        blocks = md.block_tables[i, :-(-sl // page)].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[-1])[:sl]  # [sl, Hkv, D]
        values = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[-1])[:sl]
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        q = case.q[qsl[i]:qsl[i + 1]].float()  # [ql, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * case.scale
        q_pos = torch.arange(sl - ql, sl, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(sl, device=q.device)[None, :] > q_pos, float("-inf"))
        out[qsl[i]:qsl[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    return float(err)  # NaN compares false against any bound


def fp8_case(case: Case, k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[Case, torch.Tensor]:
    """The case with FP8 (e4m3) caches holding its cached K / k_scale and V / v_scale (the poisoned
    slots stay NaN), and the float32 reference of the problem an FP8 backend really solves: every
    key and value, cached or new, rounded through e4m3 at its scale. An FP8 backend should then sit
    as close to this reference as a bf16 backend to reference_attention: only its arithmetic differs."""
    fp8 = dataclasses.replace(case, k_cache=quantize_fp8(case.k_cache, k_scale),
                              v_cache=quantize_fp8(case.v_cache, v_scale))

    def rounded(x, scale):
        return dequantize(quantize_fp8(x, scale), scale, torch.float32)

    solved = dataclasses.replace(case, k=rounded(case.k, k_scale), v=rounded(case.v, v_scale),
                                 k_cache=rounded(case.k_cache, k_scale), v_cache=rounded(case.v_cache, v_scale))
    return fp8, reference_attention(solved)
