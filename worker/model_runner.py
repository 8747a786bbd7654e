"""Runs the model for one SchedulerOutput: builds the step's inputs and attention metadata, runs
the forward pass inside a forward_context, and samples. Never mutates scheduler state."""

import itertools

import numpy as np
import torch

from kvmesh.worker.attention import select_backend
from kvmesh.worker.attention.base import AttentionMetadata, ForwardContext, forward_context
from kvmesh.worker.cuda_graphs import DecodeCudaGraphs
from kvmesh.worker.model_config import ModelConfig
from kvmesh.worker.sampler import SampleResult, Sampler
from kvmesh.worker.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, attention_backend: str, seed: int,
                 max_model_len: int, enforce_eager: bool = False, max_num_seqs: int = 256):
        self.model = model
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = (max_model_len + block_size - 1) // block_size
        backend_cls = select_backend(attention_backend, device, block_size)
        self.backend = backend_cls(
            num_heads=model_config.num_heads, num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim, block_size=block_size,
            scale=model_config.head_dim ** -0.5, device=device, dtype=dtype)
        # [num_layers] x (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
        shape = (model_config.num_layers, 2, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(model_config.num_layers)]
        self.sampler = Sampler(device, seed)
        # --- CUDA graphs for decode (worker/cuda_graphs.py) ---
        self.graph_runner = None
        if device.type == "cuda" and not enforce_eager and self.backend.name != "torch":
            self.graph_runner = DecodeCudaGraphs(self.model, self.backend, self.kv_caches, max_num_seqs,
                                                 self.max_blocks_per_seq, max_model_len, device)
            self.graph_runner.capture()

    def prepare(self, output: SchedulerOutput):
        # Vectorised with numpy: with hundreds of running sequences a per-token Python loop cost
        # more host time than the GPU's decode step (see docs/PERF.md).
        entries = output.scheduled
        block_size = self.block_size
        query_lens = [e.num_new_tokens for e in entries]
        starts = [e.request.num_computed_tokens for e in entries]
        seq_lens = [s + q for s, q in zip(starts, query_lens)]
        block_tables = [e.request.block_ids for e in entries]
        input_ids = []
        for e, s, q in zip(entries, starts, query_lens):
            input_ids.extend(e.request.all_token_ids[s:s + q])
        query_start_loc = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        rows = np.repeat(np.arange(len(entries)), query_lens)  # [T] sequence of each token
        positions = np.arange(len(input_ids)) - query_start_loc[rows] + np.asarray(starts, dtype=np.int64)[rows]
        # block table: the sequences' block ids, right-padded with 0
        num_blocks = np.fromiter((len(b) for b in block_tables), dtype=np.int64, count=len(entries))
        width = int(num_blocks.max())
        table = np.zeros((len(entries), width), dtype=np.int32)
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(num_blocks.sum()))
        table[np.repeat(np.arange(len(entries)), num_blocks),
              np.arange(flat.shape[0]) - np.repeat(np.cumsum(num_blocks) - num_blocks, num_blocks)] = flat
        slot_mapping = table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        samples = [e.samples for e in entries]
        logits_indices = [int(query_start_loc[i + 1]) - 1 for i, x in enumerate(samples) if x]
        num_decode_tokens = sum(1 for q, x in zip(query_lens, samples) if q == 1 and x)
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            num_decode_tokens=num_decode_tokens)
        inputs = (torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True),
                  torch.from_numpy(positions).to(dev, non_blocking=True))
        return inputs, metadata, logits_indices

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> SampleResult | None:
        """Forward the step's tokens; sample one token for each entry that reached its last token."""
        (input_ids, positions), metadata, logits_indices = self.prepare(output)
        if self.graph_runner is not None and self.graph_runner.can_run(metadata):
            hidden = self.graph_runner.run(input_ids, positions, metadata)  # [T, hidden]
        else:
            self.backend.plan(metadata)
            with forward_context(ForwardContext(metadata, self.backend, self.kv_caches)):
                hidden = self.model(input_ids, positions)  # [T, hidden]
        if not logits_indices:
            return None
        index = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[index])  # [N, vocab]
        sampling = [e.request for e in output.scheduled if e.samples]
        return self.sampler.sample(logits, sampling)
