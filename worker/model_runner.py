"""Runs the model for one SchedulerOutput: builds the step's inputs and attention metadata, runs
the forward pass inside a forward_context, and samples. Never mutates scheduler state."""

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
        input_ids, positions, slot_mapping = [], [], []
        query_lens, seq_lens, block_tables = [], [], []
        logits_indices = []
        num_decode_tokens = 0
        for entry in output.scheduled:
            request = entry.request
            start = request.num_computed_tokens
            end = start + entry.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            for pos in range(start, end):
                slot_mapping.append(request.block_ids[pos // self.block_size] * self.block_size
                                    + pos % self.block_size)
            query_lens.append(entry.num_new_tokens)
            seq_lens.append(end)
            block_tables.append(request.block_ids)
            if entry.samples:
                logits_indices.append(len(input_ids) - 1)
            if entry.num_new_tokens == 1 and entry.samples:
                num_decode_tokens += 1
        width = max(len(b) for b in block_tables)
        table = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, blocks in enumerate(block_tables):
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        query_start_loc = [0]
        for q in query_lens:
            query_start_loc.append(query_start_loc[-1] + q)
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=table.to(dev, non_blocking=True),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(dev, non_blocking=True),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            num_decode_tokens=num_decode_tokens)
        inputs = (torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True),
                  torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True))
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
