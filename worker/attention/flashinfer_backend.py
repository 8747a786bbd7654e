"""The `flashinfer` attention backend: flashinfer's paged BatchDecode / BatchPrefill wrappers.

plan() runs once per step: it turns the block tables into flashinfer's page lists (indptr and
last-page lengths on the host, where flashinfer's scheduler wants them, so no device sync; page
indices gathered on the device) and plans the decode wrapper for the leading one-token sequences
and the prefill wrapper for the prompt chunks. One workspace buffer serves every wrapper.
For CUDA graphs, a decode wrapper per captured batch size owns fixed page-list buffers, and is
re-planned before each replay.
An FP8 KV cache is flashinfer's own: the wrappers are planned with kv_data_type float8_e4m3fn (q
stays in the model dtype) and run with the layer's k_scale / v_scale (flashinfer folds k_scale into
the softmax scale and multiplies the output by v_scale); kvmesh's store kernel quantizes.
"""

import numpy as np
import torch

from .base import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def setup(self) -> None:
        import flashinfer  # imported here: optional dependency (kvmesh[gpu])
        from kvmesh.kernels.store_kvcache import store_kvcache

        self._flashinfer = flashinfer
        self._store = store_kvcache
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # tensor-core decode pays once several query heads share a KV head
        self.use_tensor_cores = self.num_heads // self.num_kv_heads >= 4
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
        # fa2: flashinfer's sm90 (fa3) prefill needs CUTLASS tool headers the trimmed wheel leaves out;
        # fa2 modules are the ones tensor-core decode builds anyway
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.graph_decode_wrappers: dict[int, object] = {}

    def _graph_decode_wrapper(self, batch_size: int, max_blocks_per_seq: int):
        wrapper = self.graph_decode_wrappers.get(batch_size)
        if wrapper is None:
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(batch_size * max_blocks_per_seq, dtype=torch.int32,
                                                    device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device))
            self.graph_decode_wrappers[batch_size] = wrapper
        return wrapper

    def plan(self, metadata: AttentionMetadata) -> None:
        page = self.block_size
        seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
        num_pages = (seq_lens + page - 1) // page  # [S]
        kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int64)
        np.cumsum(num_pages, out=kv_indptr[1:])
        last_page_len = seq_lens - (num_pages - 1) * page
        # page indices: the first num_pages[i] entries of block table row i, flattened
        rows = np.repeat(np.arange(len(seq_lens)), num_pages)
        cols = np.arange(kv_indptr[-1]) - np.repeat(kv_indptr[:-1], num_pages)
        flat = torch.from_numpy(rows * metadata.block_tables.shape[1] + cols).to(self.device, non_blocking=True)
        indices = metadata.block_tables.reshape(-1)[flat]  # [total pages] int32, on device

        num_decodes = metadata.num_decode_tokens
        common = dict(num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads, page_size=page,
                      q_data_type=self.dtype, kv_data_type=self.kv_cache_dtype, sm_scale=self.scale)
        if num_decodes:
            graph_batch = metadata.extra.get("cuda_graph_batch_size")
            wrapper = (self._graph_decode_wrapper(graph_batch, metadata.block_tables.shape[1])
                       if graph_batch else self.decode_wrapper)
            wrapper.plan(torch.from_numpy(kv_indptr[:num_decodes + 1].astype(np.int32)),
                         indices[:kv_indptr[num_decodes]],
                         torch.from_numpy(last_page_len[:num_decodes].astype(np.int32)),
                         head_dim=self.head_dim, **common)
            metadata.extra["flashinfer_decode"] = wrapper
        if num_decodes < metadata.num_seqs:
            query_lens = np.asarray(metadata.query_lens_cpu[num_decodes:], dtype=np.int64)
            qo_indptr = np.zeros(len(query_lens) + 1, dtype=np.int32)
            np.cumsum(query_lens, out=qo_indptr[1:])
            self.prefill_wrapper.plan(
                torch.from_numpy(qo_indptr),
                torch.from_numpy((kv_indptr[num_decodes:] - kv_indptr[num_decodes]).astype(np.int32)),
                indices[kv_indptr[num_decodes]:],
                torch.from_numpy(last_page_len[num_decodes:].astype(np.int32)),
                head_dim_qk=self.head_dim, causal=True, **common)
        metadata.extra["flashinfer_planned"] = True

    def forward(self, q, k, v, k_cache, v_cache, metadata, k_scale=1.0, v_scale=1.0):
        if not metadata.extra.get("flashinfer_planned"):
            self.plan(metadata)
        if k is not None:  # None: the rotation's launch already wrote them
            self._store(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        # None when there is nothing to scale: flashinfer then skips its `out *= v_scale`
        scales = dict(k_scale=k_scale, v_scale=v_scale) if self.fp8_kv else {}
        q = q.contiguous()
        out = torch.empty_like(q)  # [T, H, D]
        num_decodes = metadata.num_decode_tokens
        if num_decodes:
            metadata.extra["flashinfer_decode"].run(q[:num_decodes], (k_cache, v_cache), out=out[:num_decodes],
                                                    **scales)
        if num_decodes < q.shape[0]:
            self.prefill_wrapper.run(q[num_decodes:], (k_cache, v_cache), out=out[num_decodes:], **scales)
        return out
