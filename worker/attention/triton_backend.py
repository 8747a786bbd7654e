"""The `triton` attention backend: kvmesh's own kernels (kvmesh.kernels), on any CUDA GPU.

Per layer: store the step's K/V by slot mapping, then the decode kernel for the leading one-token
sequences (in splits of 512 keys, kvmesh.kernels.paged_decode's chunk mode; KVMESH_DECODE_CHUNK=0:
as many equal splits as fill the SMs) and the prefill kernel for the prompt chunks, each writing its
rows of one output.
With an FP8 cache the store quantizes by the layer's scales and both kernels dequantize as they read.
"""

import torch

from .base import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def setup(self) -> None:
        # imported here so that CPU-only installs (no triton) can still import the backend registry
        from kvmesh.kernels.paged_decode import choose_num_splits, chunk_config_from_env, chunk_splits, paged_decode
        from kvmesh.kernels.paged_prefill import paged_prefill
        from kvmesh.kernels.store_kvcache import store_kvcache
        self._choose_num_splits = choose_num_splits
        self._chunk_splits = chunk_splits
        self._decode = paged_decode
        self._prefill = paged_prefill
        self._store = store_kvcache
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._chunked = chunk_config_from_env() or {}  # KVMESH_DECODE_CHUNK; {}: splits by SM count

    def _num_splits(self, num_decodes: int, max_seq_len: int) -> int:
        if self._chunked:
            return self._chunk_splits(max_seq_len, self._chunked)
        return self._choose_num_splits(num_decodes, self.num_kv_heads, max_seq_len, self.num_sms)

    def plan(self, metadata: AttentionMetadata) -> None:
        num_decodes = metadata.num_decode_tokens
        # Under CUDA-graph capture max_seq_len is the model's limit, so the captured split count
        # suits any context the graph will later see.
        metadata.extra["num_splits"] = self._num_splits(num_decodes, metadata.max_seq_len) if num_decodes else 1

    def forward(self, q, k, v, k_cache, v_cache, metadata, k_scale=1.0, v_scale=1.0):
        self.store(k, v, k_cache, v_cache, metadata, k_scale, v_scale)
        out = torch.empty_like(q)  # [T, H, D]
        num_decodes = metadata.num_decode_tokens
        num_tokens = q.shape[0]
        if num_decodes:
            num_splits = metadata.extra.get("num_splits")
            if num_splits is None:
                num_splits = self._num_splits(num_decodes, metadata.max_seq_len)
            self._decode(q[:num_decodes], k_cache, v_cache, out[:num_decodes],
                         metadata.seq_lens[:num_decodes], metadata.block_tables[:num_decodes],
                         self.scale, num_splits, k_scale, v_scale, **self._chunked)
        if num_decodes < num_tokens:
            self._prefill(q, k_cache, v_cache, out, metadata.query_start_loc, metadata.seq_lens,
                          metadata.block_tables, metadata.max_query_len, self.scale, k_scale, v_scale,
                          first_seq=num_decodes)
        return out
