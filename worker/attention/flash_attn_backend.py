"""The `flash_attn` attention backend: flash-attn 2's paged prefill, and on a GPU kvmesh's Triton
paged decode.

Prompt chunks go through `flash_attn_varlen_func` with `block_table` (the cached prefix is read from
the pool; cu_seqlens_k counts whole contexts). Decodes go through kvmesh.kernels.paged_decode in
splits of 512 keys (its chunk mode), which reads the KV at ~94% of the copy rate at the engine's
batches where `flash_attn_with_kvcache` reads at 82% (docs/PERF.md "Attention kernels");
KVMESH_DECODE_CHUNK=0 decodes through `flash_attn_with_kvcache` with `cache_seqlens` instead (and
on the CPU, where the interface test runs, it always does). The step's K/V is stored first (by
kvmesh's store_kvcache, or by the rotation's launch: forward's k = v = None), so every call only
reads.
flash-attn's paged mode needs a block size that is a multiple of 256 (registry.BACKENDS, checked
when the backend is built). No FP8 KV cache: flash-attn 2's kernels read K/V in the query's dtype
and take no descale (registry.BACKENDS says so; asking for it is an error naming kv_cache_dtype).
"""

import os

import torch

from .base import AttentionBackend, AttentionMetadata

# With KVMESH_DECODE_CHUNK=0: flash_attn_with_kvcache's num_splits for decode steps. 0 leaves it to
# flash-attn's heuristic, which under CUDA graphs sees only the block table's width (max_model_len),
# not the contexts. Measured alone
# (bench/gpu_kernels.py --fa-splits, docs/PERF.md) 1 was as fast within 1% at batches of 32-256 (where
# the heuristic picks 1 too) and faster at 8-16 (15-30 us against 27-46); end to end not yet measured,
# so the default stays 0. KVMESH_FA_DECODE_SPLITS sets it (A/B runs).
DECODE_SPLITS = int(os.environ.get("KVMESH_FA_DECODE_SPLITS", "0"))


class FlashAttnAttentionBackend(AttentionBackend):
    name = "flash_attn"

    def setup(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # optional dependency

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._store = _store_function(self.device)
        self._chunked = None  # decodes by kvmesh's Triton kernel in chunks of keys (KVMESH_DECODE_CHUNK)
        if torch.device(self.device).type == "cuda":
            from kvmesh.kernels.paged_decode import chunk_config_from_env, chunk_splits, paged_decode
            self._chunked = chunk_config_from_env()
            self._chunk_splits = chunk_splits
            self._paged_decode = paged_decode

    def plan(self, metadata: AttentionMetadata) -> None:
        num_decodes = metadata.num_decode_tokens
        if num_decodes < metadata.num_seqs:
            prefill_seq_lens = metadata.seq_lens[num_decodes:]
            cu_seqlens_k = torch.zeros(prefill_seq_lens.shape[0] + 1, dtype=torch.int32, device=self.device)
            torch.cumsum(prefill_seq_lens, 0, out=cu_seqlens_k[1:])
            metadata.extra["flash_attn_cu_seqlens_k"] = cu_seqlens_k  # [S_prefill + 1]
            metadata.extra["flash_attn_max_seqlen_k"] = max(metadata.seq_lens_cpu[num_decodes:])
            metadata.extra["flash_attn_max_seqlen_q"] = max(metadata.query_lens_cpu[num_decodes:])

    def forward(self, q, k, v, k_cache, v_cache, metadata, k_scale=1.0, v_scale=1.0):  # scales: FP8 only
        self.store(k, v, k_cache, v_cache, metadata, k_scale, v_scale)
        num_decodes = metadata.num_decode_tokens
        if num_decodes:
            decode_out = self._decode(q[:num_decodes], k_cache, v_cache, metadata)
            if num_decodes == q.shape[0]:  # a decode step: no copy into a joint output
                return decode_out
        out = torch.empty_like(q)  # [T, H, D]
        if num_decodes:
            out[:num_decodes] = decode_out
        if num_decodes < q.shape[0]:
            if "flash_attn_cu_seqlens_k" not in metadata.extra:
                self.plan(metadata)
            query_start_loc = metadata.query_start_loc[num_decodes:]
            out[num_decodes:] = self._varlen(
                q[num_decodes:], k_cache, v_cache,
                cu_seqlens_q=query_start_loc - query_start_loc[0],
                cu_seqlens_k=metadata.extra["flash_attn_cu_seqlens_k"],
                max_seqlen_q=metadata.extra["flash_attn_max_seqlen_q"],
                max_seqlen_k=metadata.extra["flash_attn_max_seqlen_k"],
                softmax_scale=self.scale, causal=True,
                block_table=metadata.block_tables[num_decodes:])
        return out

    def _decode(self, q, k_cache, v_cache, metadata) -> torch.Tensor:
        """The decode rows' attention [B, H, D]: kvmesh's Triton kernel in chunks of keys, or
        flash_attn_with_kvcache (KVMESH_DECODE_CHUNK=0, and on the CPU)."""
        num_decodes = q.shape[0]
        seq_lens, block_table = metadata.seq_lens[:num_decodes], metadata.block_tables[:num_decodes]
        if self._chunked:
            out = torch.empty_like(q)
            self._paged_decode(q, k_cache, v_cache, out, seq_lens, block_table, self.scale,
                               self._chunk_splits(metadata.max_seq_len, self._chunked), **self._chunked)
            return out
        return self._with_kvcache(q.unsqueeze(1), k_cache, v_cache,  # q as [B, 1, H, D]
                                  cache_seqlens=seq_lens, block_table=block_table, softmax_scale=self.scale,
                                  causal=True, num_splits=DECODE_SPLITS).squeeze(1)


def _store_function(device: torch.device):
    """The Triton store on a GPU; the torch backend's indexed copy elsewhere (the CPU interface test)."""
    if torch.device(device).type == "cuda":
        from kvmesh.kernels.store_kvcache import store_kvcache
        return store_kvcache
    from .torch_backend import store_kvcache_torch
    return store_kvcache_torch
