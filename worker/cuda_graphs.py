"""CUDA graphs for decode steps: the model forward captured once per batch size of a ladder, replayed
with the step's inputs copied into static buffers.

A decode step (every sequence computes one new token) of n sequences replays the graph of the
smallest captured batch size >= n; the padding rows get slot -1 (store_kvcache skips them), context
length 1 and whatever block ids their table rows last held, and their outputs are dropped. Steps with
prompt chunks, or more sequences than the largest size, run eagerly. The attention backend's plan()
still runs on the host before each replay (flashinfer re-plans its graph wrapper's fixed buffers;
the Triton kernels read lengths and tables from the static buffers). Captured with max_seq_len set to
the model's limit, so a split-KV decode's captured split count suits any context.
"""

import torch

from kvmesh.worker.attention.base import AttentionMetadata, ForwardContext, forward_context


def batch_size_ladder(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch_size (the largest is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


class DecodeCudaGraphs:
    def __init__(self, model, backend, kv_caches, max_batch_size: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device, kv_scales=None):
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales  # per layer (k_scale, v_scale), captured as constants
        self.max_model_len = max_model_len
        self.batch_sizes = batch_size_ladder(max_batch_size)
        n = self.batch_sizes[-1]
        # static inputs, shared by every graph (each graph reads a leading slice)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.metadata: dict[int, AttentionMetadata] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [batch, hidden] written by each replay

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[:batch],
            query_lens_cpu=[1] * batch, seq_lens_cpu=[1] * batch, max_query_len=1,
            max_seq_len=self.max_model_len, num_decode_tokens=batch,
            extra={"cuda_graph_batch_size": batch})

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        # largest first: the smaller graphs then fit in the memory pool the largest left behind
        for batch in reversed(self.batch_sizes):
            metadata = self._metadata(batch)
            self.backend.plan(metadata)
            context = ForwardContext(metadata, self.backend, self.kv_caches, self.kv_scales)
            with forward_context(context):  # warm-up: kernel compilation and autotuning happen outside the graph
                self.model(self.input_ids[:batch], self.positions[:batch])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                with forward_context(context):
                    self.outputs[batch] = self.model(self.input_ids[:batch], self.positions[:batch])
            pool = graph.pool() if pool is None else pool
            self.graphs[batch] = graph
            self.metadata[batch] = metadata
        torch.cuda.synchronize()

    def can_run(self, metadata: AttentionMetadata) -> bool:
        num_seqs = metadata.num_seqs
        return (0 < num_seqs <= self.max_batch_size and metadata.num_decode_tokens == num_seqs
                and metadata.num_tokens == num_seqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Replay the decode step; returns the final hidden states [num_seqs, hidden]."""
        n = metadata.num_seqs
        batch = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        if batch > n:
            self.slot_mapping[n:batch].fill_(-1)
            self.seq_lens[n:batch].fill_(1)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        graph_metadata = self.metadata[batch]
        graph_metadata.seq_lens_cpu = list(metadata.seq_lens_cpu) + [1] * (batch - n)
        graph_metadata.extra = {"cuda_graph_batch_size": batch}
        self.backend.plan(graph_metadata)
        self.graphs[batch].replay()
        return self.outputs[batch][:n]
