"""CUDA graphs for decode steps: the model forward captured once per batch size of a ladder, replayed
with the step's inputs copied into static buffers.

A decode step (every sequence computes one new token) of n sequences replays the graph of the
smallest captured batch size >= n; the padding rows get slot -1 (store_kvcache skips them), context
length 1 and whatever block ids their table rows last held, and their outputs are dropped. Steps with
prompt chunks, or more sequences than the largest size, run eagerly. The attention backend's plan()
still runs on the host before each replay (flashinfer re-plans its graph wrapper's fixed buffers;
the Triton kernels read lengths and tables from the static buffers). Captured with max_seq_len set to
the model's limit, so a split-KV decode's captured split count suits any context.

The static inputs are views of one device buffer of bytes; `run_step` (the single-GPU runner's
decode steps) fills a pinned mirror of it on the host, padding rows included, and updates them all
with one host-to-device copy, then writes the step's placeholder tokens from the previous step's
samples with one gather and one scatter: three launches before the replay instead of a dozen (each
a wait for the host once the device has drained its queue). `run` takes device tensors (tensor
parallelism's broadcast step, tests).
"""

import numpy as np
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
        # static inputs, shared by every graph (each graph reads a leading slice): views of one
        # buffer of bytes, with a pinned mirror on the host for each of two steps in flight
        self.layout = _packed_layout(n, max_blocks_per_seq)
        size = self.layout["_bytes"]
        self.packed = torch.zeros(size, dtype=torch.uint8, device=device)
        views = _views(self.packed, self.layout)
        self.input_ids, self.positions, self.slot_mapping = views["input_ids"], views["positions"], views["slot_mapping"]
        self.seq_lens, self.block_tables = views["seq_lens"], views["block_tables"]
        self.flat, self.rows = views["flat"], views["rows"]  # placeholder tokens: where, and whence
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.mirrors = [torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda") for _ in range(2)]
        self.mirror_views = [{k: v.numpy() for k, v in _views(m, self.layout).items()} for m in self.mirrors]
        self.mirror_copied = [None, None]  # the event after each mirror's last copy
        self.next_mirror = 0
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
        return self.fits(metadata.num_seqs, metadata.num_tokens, metadata.num_decode_tokens)

    def fits(self, num_seqs: int, num_tokens: int, num_decode_tokens: int) -> bool:
        """A step of one decode token per sequence, no more sequences than the largest graph."""
        return 0 < num_seqs <= self.max_batch_size and num_decode_tokens == num_seqs == num_tokens

    def run_step(self, step, pending: tuple[list[int], list[int]] | None,
                 previous_tokens: torch.Tensor | None) -> torch.Tensor:
        """Replay the decode step of `step` (a HostStep that fits); `pending`: (row of a placeholder
        token, its row in previous_tokens). Returns the final hidden states [num_seqs, hidden]."""
        return self._replay(self.load_step(step, pending, previous_tokens), step.seq_lens)

    def load_step(self, step, pending: tuple[list[int], list[int]] | None,
                  previous_tokens: torch.Tensor | None) -> int:
        """The step's inputs into the static buffers (padding rows up to the graph's batch size
        included) by one copy of a pinned mirror, then its placeholder tokens from
        previous_tokens; returns the graph's batch size."""
        n = len(step.seq_lens)
        batch = self._graph_batch(n)
        i = self.next_mirror
        self.next_mirror = 1 - i
        if self.mirror_copied[i] is not None:  # its copy two steps ago: long done, unless the
            self.mirror_copied[i].synchronize()  # device is two steps behind
        v = self.mirror_views[i]
        v["input_ids"][:n] = step.input_ids
        v["positions"][:n] = step.positions
        v["slot_mapping"][:n] = step.slot_mapping
        v["seq_lens"][:n] = step.seq_lens
        v["input_ids"][n:batch] = 0
        v["positions"][n:batch] = 0
        v["slot_mapping"][n:batch] = -1  # padding rows store nothing (store_kvcache skips -1)
        v["seq_lens"][n:batch] = 1
        width = step.block_table.shape[1]
        v["block_tables"][:n, :width] = step.block_table
        k = len(pending[0]) if pending else 0
        if k:
            v["flat"][:k], v["rows"][:k] = pending
        self.packed.copy_(self.mirrors[i], non_blocking=True)
        copied = torch.cuda.Event() if self.packed.is_cuda else None
        if copied is not None:
            copied.record()
        self.mirror_copied[i] = copied
        if k:
            self.input_ids[self.flat[:k]] = previous_tokens[self.rows[:k]]
        return batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Replay the decode step; returns the final hidden states [num_seqs, hidden]."""
        n = metadata.num_seqs
        batch = self._graph_batch(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        if batch > n:
            self.slot_mapping[n:batch].fill_(-1)
            self.seq_lens[n:batch].fill_(1)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        return self._replay(batch, metadata.seq_lens_cpu)

    def _graph_batch(self, n: int) -> int:
        """The batch size of the graph that runs n sequences: the smallest captured one >= n."""
        return next(b for b in self.batch_sizes if b >= n)

    def _replay(self, batch: int, seq_lens_cpu: list[int]) -> torch.Tensor:
        """Plan the backend for the graph of `batch` (its padding rows a context of 1), replay it,
        and return the real rows' final hidden states."""
        n = len(seq_lens_cpu)
        graph_metadata = self.metadata[batch]
        graph_metadata.seq_lens_cpu = list(seq_lens_cpu) + [1] * (batch - n)
        graph_metadata.extra = {"cuda_graph_batch_size": batch}
        self.backend.plan(graph_metadata)
        self.graphs[batch].replay()
        return self.outputs[batch][:n]


_PACKED = (("input_ids", torch.int64, 1), ("positions", torch.int64, 1), ("slot_mapping", torch.int64, 1),
           ("flat", torch.int64, 1), ("rows", torch.int64, 1), ("seq_lens", torch.int32, 1),
           ("block_tables", torch.int32, None))


def _packed_layout(rows: int, width: int) -> dict:
    """Byte offset and shape of each static input in the packed buffer (each aligned to 256 bytes)."""
    layout, offset = {}, 0
    for name, dtype, per_row in _PACKED:
        shape = (rows,) if per_row == 1 else (rows, width)
        layout[name] = (offset, dtype, shape)
        offset += -(-int(np.prod(shape)) * dtype.itemsize // 256) * 256
    layout["_bytes"] = offset
    return layout


def _views(buffer: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    views = {}
    for name, entry in layout.items():
        if name.startswith("_"):
            continue
        offset, dtype, shape = entry
        size = int(np.prod(shape)) * dtype.itemsize
        views[name] = buffer[offset:offset + size].view(dtype).view(shape)
    return views
