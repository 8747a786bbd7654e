"""The reference attention backend: plain PyTorch over the paged cache, one sequence at a time.

Every other backend is checked against this one. It reads K/V through the block table exactly as
the fast kernels do, so a bug in block tables or slot mapping shows up here too. With an FP8 cache
it quantizes on store and dequantizes what it gathers (worker/kv_cache.py), in float32.
"""

import torch
import torch.nn.functional as F

from kvmesh.worker.attention.base import AttentionBackend, AttentionMetadata
from kvmesh.worker.kv_cache import dequantize, is_fp8, quantize_fp8


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write new K/V ([T, Hkv, D]) into the paged caches at their slots (slot -1 is skipped);
    into an FP8 cache as K / k_scale and V / v_scale."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    if is_fp8(k_cache.dtype):
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    _raw(k_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _raw(k))
    _raw(v_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _raw(v))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes: indexed copies of float8 dtypes are not implemented on every
    device and torch version; bytes are moved exactly."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = _raw(cache)[block_table[:num_blocks].long()].view(cache.dtype)  # [num_blocks, B, Hkv, D]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    _store = staticmethod(store_kvcache_torch)

    def forward(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, k_scale=1.0, v_scale=1.0):
        self.store(k, v, k_cache, v_cache, metadata, k_scale, v_scale)
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            qi = q[start:start + query_len].transpose(0, 1)  # [H, q, D]
            keys = dequantize(gather_context(k_cache, metadata.block_tables[i], seq_len), k_scale, q.dtype)
            values = dequantize(gather_context(v_cache, metadata.block_tables[i], seq_len), v_scale, q.dtype)
            keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, s, D]
            values = values.transpose(0, 1).repeat_interleave(group, dim=0)
            # Query j (absolute position seq_len - query_len + j) sees keys 0..that position.
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos  # [q, s]
            attn = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, scale=self.scale)
            out[start:start + query_len] = attn.transpose(0, 1)
            start += query_len
        return out
