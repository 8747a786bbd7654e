"""The `flashinfer` attention backend: flashinfer's paged BatchDecode / BatchPrefill wrappers, and,
opt-in, TensorRT-LLM's XQA kernel (flashinfer's xqa_batch_decode_with_kv_cache) for decodes.

plan() runs once per step: it turns the block tables into flashinfer's page lists (indptr and
last-page lengths on the host, where flashinfer's scheduler wants them, so no device sync; page
indices gathered on the device) and plans the decode wrapper for the leading one-token sequences
and the prefill wrapper for the prompt chunks. One workspace buffer serves every wrapper.
For CUDA graphs, a decode wrapper per captured batch size owns fixed page-list buffers, and is
re-planned before each replay.
XQA (KVMESH_XQA_DECODE=1; `xqa_supported`: SM90 / SM100 / SM120, pages of 16, 32, 64 or 128, head_dim
128, K/V in the model dtype) reads the block table and the context lengths on the device and needs no plan, so
a decode step has no host work. Alone at the engine's shape it was 10-15% faster than flash-attn and
BatchDecode at pages of 64-128 (bench/gpu_kernels.py --decode-mix); over nano-vllm's whole run its
attention time equalled theirs (4.12 s against 4.05 + 0.06 merge and 4.20 s; docs/PERF.md), so it
stays off by default. It keeps its own zeroed workspace: its first 8 MiB are semaphores that must
read 0 between launches, which the wrappers' scratch writes would break.
An FP8 KV cache is flashinfer's own: the wrappers are planned with kv_data_type float8_e4m3fn (q
stays in the model dtype) and run with the layer's k_scale / v_scale (flashinfer folds k_scale into
the softmax scale and multiplies the output by v_scale); kvmesh's store kernel quantizes.
"""

import os

import numpy as np
import torch

from .base import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 256 * 1024 * 1024
XQA_DECODE = os.environ.get("KVMESH_XQA_DECODE", "0") == "1"
XQA_PAGE_SIZES = (16, 32, 64, 128)  # flashinfer.jit.xqa builds these
XQA_WORKSPACE_BYTES = 8 * 1024 * 1024 + 32 * 1024 * 1024  # semaphores, then multi-block scratch


def xqa_supported(device: torch.device, block_size: int, head_dim: int, dtype: torch.dtype,
                  kv_cache_dtype: torch.dtype) -> bool:
    """Whether the XQA decode kernel takes this configuration: the one verified on an H200
    (tests/gpu: head_dim 128, K/V in the model dtype; XQA's FP8 kernel and other head dims are not)."""
    return (XQA_DECODE and torch.device(device).type == "cuda"
            and torch.cuda.get_device_capability(device)[0] in (9, 10, 12)
            and block_size in XQA_PAGE_SIZES and head_dim == 128
            and dtype in (torch.bfloat16, torch.float16) and kv_cache_dtype == dtype)


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
        self.xqa = xqa_supported(self.device, self.block_size, self.head_dim, self.dtype, self.kv_cache_dtype)
        if self.xqa:
            from flashinfer.decode import xqa_batch_decode_with_kv_cache
            self._xqa_decode = xqa_batch_decode_with_kv_cache
            self.xqa_workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)

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
        metadata.extra["flashinfer_planned"] = True
        num_decodes = metadata.num_decode_tokens
        if self.xqa and num_decodes == metadata.num_seqs:
            return  # XQA reads the block table and context lengths as they are
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

        common = dict(num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads, page_size=page,
                      q_data_type=self.dtype, kv_data_type=self.kv_cache_dtype, sm_scale=self.scale)
        if num_decodes and not self.xqa:
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

    def forward(self, q, k, v, k_cache, v_cache, metadata, k_scale=1.0, v_scale=1.0):
        if not metadata.extra.get("flashinfer_planned"):
            self.plan(metadata)
        self.store(k, v, k_cache, v_cache, metadata, k_scale, v_scale)
        # None when there is nothing to scale: flashinfer then skips its `out *= v_scale`
        scales = dict(k_scale=k_scale, v_scale=v_scale) if self.fp8_kv else {}
        q = q.contiguous()
        out = torch.empty_like(q)  # [T, H, D]
        num_decodes = metadata.num_decode_tokens
        if num_decodes and self.xqa:
            self._xqa_decode(q[:num_decodes], (k_cache, v_cache), self.xqa_workspace,
                             metadata.block_tables[:num_decodes], metadata.seq_lens[:num_decodes],
                             metadata.block_tables.shape[1] * self.block_size, bmm1_scale=self.scale,
                             out=out[:num_decodes])
        elif num_decodes:
            metadata.extra["flashinfer_decode"].run(q[:num_decodes], (k_cache, v_cache), out=out[:num_decodes],
                                                    **scales)
        if num_decodes < q.shape[0]:
            self.prefill_wrapper.run(q[num_decodes:], (k_cache, v_cache), out=out[num_decodes:], **scales)
        return out
