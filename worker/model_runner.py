"""Runs the model for one SchedulerOutput: builds the step's inputs and attention metadata, runs
the forward pass inside a forward_context, and samples. Never mutates scheduler state.

Under tensor parallelism (tp.size > 1) the runner of rank 0 broadcasts each step's inputs
(step_broadcast.py) and every rank runs the same forward on them; the runners of the other ranks
only `follow()`: they never see a SchedulerOutput, and compute logits only to take their part in
the gather (rank 0 samples)."""

import itertools
import os

import numpy as np
import torch

from kvmesh.worker.attention import select_backend
from kvmesh.worker.attention.registry import uses_cuda_graphs
from kvmesh.worker.attention.base import AttentionMetadata, ForwardContext, forward_context
from kvmesh.worker.compile import compile_layers
from kvmesh.worker.cuda_graphs import DecodeCudaGraphs
from kvmesh.worker.host_to_device import to_device
from kvmesh.worker.kv_cache import DEFAULT_KV_SCALE, kv_cache_torch_dtype
from kvmesh.worker.model_config import ModelConfig
from kvmesh.worker.prompt_logprobs import PromptLogprobsChunk, logit_slices, score_prompt_tokens
from kvmesh.worker.sampler import PendingSample, Sampler
from kvmesh.worker.scheduler import SchedulerOutput
from kvmesh.worker.step_broadcast import HostStep, StepChannel, StepInputs
from kvmesh.worker.tensor_parallel import SINGLE, TensorParallel, local_heads


# Decode steps a CUDA graph fits load their inputs with one copy (DecodeCudaGraphs.run_step);
# KVMESH_PACKED_DECODE_INPUTS=0 copies each input apart as before (A/B runs).
PACKED_DECODE_INPUTS = os.environ.get("KVMESH_PACKED_DECODE_INPUTS", "1") != "0"


class ModelRunner:
    def __init__(self, model, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, attention_backend: str, seed: int,
                 max_model_len: int, enforce_eager: bool = False, max_num_seqs: int = 256,
                 torch_compile: bool = False, tp: TensorParallel = SINGLE, kv_cache_dtype: str = "auto",
                 max_num_batched_tokens: int | None = None):
        """`max_num_batched_tokens`: the largest step the scheduler makes; on CUDA the runner runs
        prompt steps of the sizes that compile kernels of their own up to it (warm_up_prompt_steps)."""
        self.model = model
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = (max_model_len + block_size - 1) // block_size
        self.tp = tp
        self.channel = StepChannel(device) if tp.size > 1 else None
        num_heads, num_kv_heads = local_heads(model_config.num_heads, model_config.num_kv_heads, tp.size)
        backend_cls = select_backend(attention_backend, device, block_size, model_config.head_dim, dtype,
                                     kv_cache_dtype)
        self.backend = backend_cls(
            num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=model_config.head_dim, block_size=block_size,
            scale=model_config.head_dim ** -0.5, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
        # [num_layers] x (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
        # (this rank's KV heads under tensor parallelism)
        shape = (model_config.num_layers, 2, num_blocks, block_size, num_kv_heads, model_config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(model_config.num_layers)]
        # per layer (k_scale, v_scale) of an FP8 cache: fixed for the engine's life (CUDA graphs
        # capture them as constants); 1.0 without calibration, as vLLM
        self.kv_scales = [(DEFAULT_KV_SCALE, DEFAULT_KV_SCALE)] * model_config.num_layers
        self.sampler = Sampler(device, seed)
        self._prompt_logprobs: list[PromptLogprobsChunk] = []  # the last step's, until taken
        if torch_compile:  # before the graphs are captured: their warm-up runs compile it
            compile_layers(self.model)
        if device.type == "cuda" and max_num_batched_tokens:
            self.warm_up_prompt_steps(max_num_batched_tokens)
        # --- CUDA graphs for decode (worker/cuda_graphs.py) ---
        self.graph_runner = None
        if uses_cuda_graphs(self.backend.name, device.type, enforce_eager):
            self.graph_runner = DecodeCudaGraphs(self.model, self.backend, self.kv_caches, max_num_seqs,
                                                 self.max_blocks_per_seq, max_model_len, device,
                                                 kv_scales=self.kv_scales)
            self.graph_runner.capture()
            if os.environ.get("KVMESH_WARM_LOGITS", "1") != "0":
                self.warm_up_logits(max_num_seqs)

    @torch.inference_mode()
    def warm_up_logits(self, max_rows: int) -> None:
        """The LM head at every decode batch size (it runs outside the graphs, on the real rows):
        cuBLAS picks its kernel by the row count, and the first use of each costs the step that
        meets it ~0.3-0.5 ms (offline, as the batch shrinks: pairs of slow steps near multiples
        of 8; docs/PERF.md "What limits it")."""
        hidden = torch.zeros(max_rows, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for rows in range(1, max_rows + 1):
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def warm_up_prompt_steps(self, max_tokens: int) -> list[tuple[int, int]]:
        """Run the prompt steps whose Triton kernels compile forms of their own that the decode
        graphs' capture does not, up to `max_tokens` tokens a step (and prompts up to the model's
        limit): a server's first prompts then wait for no compilation (about a second on a machine
        with no Triton cache: nvidia-h200, 2026-12-03 s22 call 1). Steps of MANY_TOKENS tokens or
        more run the rotation's many-heads form, Triton specializes integer arguments on
        divisibility by 16 (the step's token count), and the paged prefill kernel (triton backend)
        has a form for prompts of up to 32 tokens: prompts of MANY_TOKENS and MANY_TOKENS + 1 tokens,
        one after a decode row (a mixed step), and a prompt of 17 tokens after a decode row. The
        steps store no KV (slot -1) and read block 0's; under tensor parallelism every rank runs
        them, collectives included, as it builds its runner. Returns the (decode rows, prompt
        tokens) of the steps run."""
        from kvmesh.kernels.rotary import MANY_TOKENS

        steps = [(d, n) for d, n in ((0, MANY_TOKENS), (0, MANY_TOKENS + 1), (1, MANY_TOKENS), (1, 17))
                 if d + n <= max_tokens and n <= self.max_model_len]
        for decodes, n in steps:
            dev = self.device
            query_lens, seq_lens = [1] * decodes + [n], [1] * decodes + [n]
            total = decodes + n
            metadata = AttentionMetadata(
                query_start_loc=torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                block_tables=torch.zeros(decodes + 1, -(-n // self.block_size), dtype=torch.int32, device=dev),
                slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=dev),
                query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, max_query_len=n, max_seq_len=n,
                num_decode_tokens=decodes)
            positions = torch.cat([torch.zeros(decodes, dtype=torch.long, device=dev),
                                   torch.arange(n, dtype=torch.long, device=dev)])
            self.backend.plan(metadata)
            with forward_context(ForwardContext(metadata, self.backend, self.kv_caches, self.kv_scales)):
                hidden = self.model(torch.zeros(total, dtype=torch.long, device=dev), positions)
            self.model.compute_logits(hidden[-1:])
        if steps and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return steps

    def prepare_host(self, output: SchedulerOutput) -> HostStep:
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
        if any(e.forks for e in entries):  # forked sequences (parallel sampling) sample that row too
            logits_indices = [int(query_start_loc[i + 1]) - 1
                              for i, e in enumerate(entries) if e.samples for _ in range(1 + len(e.forks))]
        num_decode_tokens = sum(1 for q, x in zip(query_lens, samples) if q == 1 and x)
        return HostStep(np.asarray(input_ids, dtype=np.int64), positions, slot_mapping, query_start_loc,
                        query_lens, seq_lens, table, logits_indices, num_decode_tokens)

    def prepare(self, output: SchedulerOutput, step: HostStep | None = None):
        step = step if step is not None else self.prepare_host(output)
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=to_device(step.query_start_loc, torch.int32, dev),
            seq_lens=to_device(step.seq_lens, torch.int32, dev),
            block_tables=to_device(step.block_table, torch.int32, dev),
            slot_mapping=to_device(step.slot_mapping, torch.int64, dev),
            query_lens_cpu=step.query_lens, seq_lens_cpu=step.seq_lens,
            max_query_len=max(step.query_lens), max_seq_len=max(step.seq_lens),
            num_decode_tokens=step.num_decode_tokens)
        inputs = (to_device(step.input_ids, torch.long, dev), to_device(step.positions, torch.long, dev))
        return inputs, metadata, step.logits_indices

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, previous: PendingSample | None = None) -> PendingSample | None:
        """Launch the step's forward and sampling; the sampled tokens stay on the device (with a
        copy to the host queued). Tokens still in flight from `previous` (placeholders, -1) are read
        from its device tensor, so this step can be launched before the previous one is done."""
        if self.channel is not None:
            return self._execute_parallel(output, previous)
        step = self.prepare_host(output)
        num_seqs = len(step.seq_lens)
        if (PACKED_DECODE_INPUTS and self.graph_runner is not None and not output.blocks_to_copy and len(step.logits_indices) == num_seqs
                and self.graph_runner.fits(num_seqs, len(step.input_ids), step.num_decode_tokens)
                and all(e.request.prompt_logprobs is None for e in output.scheduled)):
            # a decode step that a graph fits, each sequence sampling once (no fork): its inputs in
            # one copy, its hidden states as they come out of the graph (no gather before the logits)
            pending = self._pending_inputs(output)
            if pending and previous is None:
                raise RuntimeError("a step has placeholder tokens but no previous step to read them from")
            hidden = self.graph_runner.run_step(step, pending, previous.tokens if pending else None)
            return self.sampler.sample_async(self.model.compute_logits(hidden),
                                             [e.request for e in output.scheduled])
        (input_ids, positions), metadata, logits_indices = self.prepare(output, step)
        if output.blocks_to_copy:  # copy on write of blocks shared by parallel sequences
            src, dst = (to_device(list(ids), torch.long, self.device) for ids in zip(*output.blocks_to_copy))
            self._copy_blocks(src, dst)
        pending = self._pending_inputs(output)
        if pending:
            if previous is None:
                raise RuntimeError("a step has placeholder tokens but no previous step to read them from")
            flat, rows = pending
            input_ids[to_device(flat, torch.long, self.device)] = previous.tokens[to_device(rows, torch.long, self.device)]
        if self.graph_runner is not None and self.graph_runner.can_run(metadata):
            hidden = self.graph_runner.run(input_ids, positions, metadata)  # [T, hidden]
        else:
            self.backend.plan(metadata)
            with forward_context(ForwardContext(metadata, self.backend, self.kv_caches, self.kv_scales)):
                hidden = self.model(input_ids, positions)  # [T, hidden]
        if any(e.request.prompt_logprobs is not None for e in output.scheduled):
            self._prompt_logprobs = score_prompt_tokens(self.model, hidden, output.scheduled)
        if not logits_indices:
            return None
        index = to_device(logits_indices, torch.long, self.device)
        logits = self.model.compute_logits(hidden[index])  # [N, vocab]
        sampling = [e.request for e in output.scheduled if e.samples]
        if len(sampling) != len(logits_indices):  # forked sequences follow their request
            sampling = [r for e in output.scheduled if e.samples for r in (e.request, *e.forks)]
        return self.sampler.sample_async(logits, sampling)

    def _execute_parallel(self, output: SchedulerOutput, previous: PendingSample | None) -> PendingSample | None:
        """Rank 0 under tensor parallelism: broadcast the step, run it as every rank does, sample."""
        host = self.prepare_host(output)
        host.blocks_to_copy = list(output.blocks_to_copy or ())
        host.logit_slices = logit_slices(output.scheduled)
        header, payload, step = self.channel.prepare(host)
        pending = self._pending_inputs(output)
        if pending:
            if previous is None:
                raise RuntimeError("a step has placeholder tokens but no previous step to read them from")
            flat, rows = pending
            step.input_ids[to_device(flat, torch.long, self.device)] = previous.tokens[to_device(rows, torch.long, self.device)]
        self.channel.send(header, payload)
        hidden = self._forward(step)
        if step.logit_slices:  # the same compute_logits calls, in the same order, as follow()
            self._prompt_logprobs = score_prompt_tokens(self.model, hidden, output.scheduled)
        if not host.logits_indices:
            return None
        logits = self.model.compute_logits(hidden[step.logits_indices])  # [N, vocab], gathered
        sampling = [e.request for e in output.scheduled if e.samples]
        if len(sampling) != len(host.logits_indices):
            sampling = [r for e in output.scheduled if e.samples for r in (e.request, *e.forks)]
        return self.sampler.sample_async(logits, sampling)

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks 1..N-1: run every step rank 0 broadcasts, until it says stop."""
        while (step := self.channel.receive()) is not None:
            hidden = self._forward(step)
            for start, end in step.logit_slices:  # prompt logprobs: rank 0 scores these rows
                self.model.compute_logits(hidden[start:end])
            if step.logits_indices.numel():
                self.model.compute_logits(hidden[step.logits_indices])

    def stop_followers(self) -> None:
        if self.channel is not None:
            self.channel.send_stop()

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """Copy KV blocks, then the model's forward (a CUDA graph when one fits): [T, hidden]."""
        if step.copy_src.numel():
            self._copy_blocks(step.copy_src, step.copy_dst)
        if self.graph_runner is not None and self.graph_runner.can_run(step.metadata):
            return self.graph_runner.run(step.input_ids, step.positions, step.metadata)
        self.backend.plan(step.metadata)
        with forward_context(ForwardContext(step.metadata, self.backend, self.kv_caches, self.kv_scales)):
            return self.model(step.input_ids, step.positions)

    def _copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy KV blocks src -> dst in every layer; an FP8 pool as bytes (indexed copies of float8
        dtypes are not implemented on every device and torch version)."""
        pool = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
        pool[:, :, dst] = pool[:, :, src]  # [layers, 2, n, block, kv_heads, head_dim]

    def take_prompt_logprobs(self) -> list[PromptLogprobsChunk]:
        """The prompt tokens scored by the last execute (for requests with prompt_logprobs)."""
        chunks, self._prompt_logprobs = self._prompt_logprobs, []
        return chunks

    @staticmethod
    def _pending_inputs(output: SchedulerOutput) -> tuple[list[int], list[int]] | None:
        """(flat token index, row in the previous step's samples) of each placeholder input."""
        flat, rows = [], []
        offset = 0
        for entry in output.scheduled:
            request = entry.request
            end = request.num_computed_tokens + entry.num_new_tokens
            if request.num_pending and end == request.num_tokens:
                # the placeholder is the last token of the sequence, hence of this chunk
                flat.append(offset + entry.num_new_tokens - 1)
                rows.append(request.pending_row)
            offset += entry.num_new_tokens
        return (flat, rows) if flat else None
