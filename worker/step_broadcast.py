"""A step's inputs, from rank 0 (which scheduled it) to the followers of a tensor-parallel group.

Rank 0 packs the step (token ids, positions, slot mapping, block tables, the rows to compute logits
for, the KV blocks to copy) into one int64 tensor, preceded by a fixed-size header, and broadcasts
both: two collectives per step, device to device with NCCL. Every rank, rank 0 included, then reads
its inputs as views of that tensor, so all ranks run the same forward on the same numbers. Block ids
are rank 0's: each rank's KV pool has the same number of blocks (its own heads in each).

The token ids are patched on rank 0's device before the broadcast (placeholders of async scheduling
are the previous step's sampled tokens, which only rank 0 holds). A header of kind STOP ends the
followers' loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from kvmesh.worker.attention.base import AttentionMetadata
from kvmesh.worker.host_to_device import to_device

STEP, STOP = 1, 0
# kind, tokens, sequences, block-table width, logits rows, block copies, prompt-logit slices,
# max query len, max seq len, decode tokens
HEADER_LEN = 10


@dataclass
class HostStep:
    """The step's inputs on the host (ModelRunner.prepare_host)."""
    input_ids: np.ndarray  # [T] int64 (placeholders -1)
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [S + 1] int64
    query_lens: list[int]  # [S]
    seq_lens: list[int]  # [S]
    block_table: np.ndarray  # [S, W] int32
    logits_indices: list[int]  # [L]
    num_decode_tokens: int
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst)
    logit_slices: list[tuple[int, int]] = field(default_factory=list)  # prompt logprobs' row ranges


@dataclass
class StepInputs:
    """What every rank runs a step's forward on (device tensors are views of the broadcast one)."""
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [L] int64
    copy_src: torch.Tensor  # [C] int64
    copy_dst: torch.Tensor  # [C] int64
    logit_slices: list[tuple[int, int]]


def pack(step: HostStep) -> tuple[list[int], np.ndarray]:
    """(header, payload) of a step."""
    num_seqs = len(step.seq_lens)
    header = [STEP, len(step.input_ids), num_seqs, step.block_table.shape[1], len(step.logits_indices),
              len(step.blocks_to_copy), len(step.logit_slices), max(step.query_lens), max(step.seq_lens),
              step.num_decode_tokens]
    copies = np.asarray(step.blocks_to_copy, dtype=np.int64).reshape(-1, 2)
    payload = np.concatenate([
        np.asarray(step.input_ids, dtype=np.int64), step.positions.astype(np.int64),
        step.slot_mapping.astype(np.int64), step.query_start_loc.astype(np.int64),
        np.asarray(step.seq_lens, dtype=np.int64), np.asarray(step.query_lens, dtype=np.int64),
        step.block_table.astype(np.int64).ravel(), np.asarray(step.logits_indices, dtype=np.int64),
        copies[:, 0], copies[:, 1], np.asarray(step.logit_slices, dtype=np.int64).ravel()])
    return header, payload


def unpack(header: list[int], payload: torch.Tensor, payload_host: np.ndarray) -> StepInputs:
    """The step's inputs as views of `payload` (on the device) and `payload_host` (its host copy)."""
    _, num_tokens, num_seqs, width, num_logits, num_copies, num_slices, max_query_len, max_seq_len, \
        num_decode_tokens = header
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs, num_seqs * width,
             num_logits, num_copies, num_copies, 2 * num_slices]
    offsets = [0, *itertools.accumulate(sizes)]
    dev = [payload[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
    host = [payload_host[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
    metadata = AttentionMetadata(
        query_start_loc=dev[3].to(torch.int32), seq_lens=dev[4].to(torch.int32),
        block_tables=dev[6].view(num_seqs, width).to(torch.int32), slot_mapping=dev[2],
        query_lens_cpu=host[5].tolist(), seq_lens_cpu=host[4].tolist(),
        max_query_len=max_query_len, max_seq_len=max_seq_len, num_decode_tokens=num_decode_tokens)
    slices = host[10].reshape(-1, 2).tolist()
    return StepInputs(dev[0], dev[1], metadata, dev[7], dev[8], dev[9], [tuple(s) for s in slices])


class StepChannel:
    """Rank 0 sends each step's inputs; the followers receive them (broadcasts from rank 0)."""

    def __init__(self, device: torch.device):
        self.device = device

    def prepare(self, step: HostStep) -> tuple[torch.Tensor, torch.Tensor, StepInputs]:
        """Rank 0: (header, payload) on the device and the step read from them (patch the token ids
        in it before send)."""
        header, payload_host = pack(step)
        header_dev = to_device(header, torch.int64, self.device)
        payload = to_device(payload_host, torch.int64, self.device)
        return header_dev, payload, unpack(header, payload, payload_host)

    def send(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        dist.broadcast(header, src=0)
        dist.broadcast(payload, src=0)

    def send_stop(self) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        header[0] = STOP
        dist.broadcast(header, src=0)

    def receive(self) -> StepInputs | None:
        """A follower's next step (None: stop). Waits for rank 0."""
        header_dev = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.broadcast(header_dev, src=0)
        header = header_dev.tolist()
        if header[0] == STOP:
            return None
        _, t, s, w, l, c, p = header[:7]
        payload = torch.empty(3 * t + 3 * s + 1 + s * w + l + 2 * c + 2 * p, dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0)
        return unpack(header, payload, payload.cpu().numpy())
