"""Tensor parallelism inside one worker: the rank's group, how heads and vocabulary split, the
checks on `tensor_parallel_size`, and the scope the parallel layers (layers/parallel.py) read their
group from when they are built.

Rank 0 is the engine (scheduler, sampling); ranks 1..N-1 are followers (tp_followers.py) that run
the same forward on the step's inputs, which rank 0 broadcasts (step_broadcast.py). Collectives go
through torch.distributed's default group: gloo on the CPU, NCCL on GPUs (one process per GPU).

Heads: each rank holds num_heads / N query heads and num_kv_heads / N KV heads. With fewer KV heads
than ranks (N a multiple of num_kv_heads) each KV head is replicated on N / num_kv_heads ranks, as
vLLM does, so every rank's query heads find their KV head locally. The vocabulary is padded to a
multiple of N (the padding rows are zero and their logits are cut before sampling).
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvmesh.worker.scoped_context import scoped

# The ranks of a worker share one node: they meet through a file (torch's FileStore), so nothing
# listens for the rendezvous (a tcp:// store listens on every interface, whatever host it names),
# and gloo / NCCL open their own sockets on the loopback interface only (the variables may be set
# to another interface by whoever starts the engine).
LOOPBACK_INTERFACE = "lo"
# A follower that dies leaves the others blocked in a collective; this bounds how long.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (size 1: no group, no collectives)."""
    rank: int = 0
    size: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (captured in a CUDA graph with NCCL)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] on each rank -> [..., size * d], rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
_current: ContextVar[TensorParallel] = ContextVar("kvmesh_tensor_parallel", default=SINGLE)


def building_with(tp: TensorParallel) -> AbstractContextManager[TensorParallel]:
    """Build a model's layers for this rank (the parallel layers read it in their __init__)."""
    return scoped(_current, tp)


def current() -> TensorParallel:
    return _current.get()


# ---- how the model splits --------------------------------------------------------------------

def local_heads(num_heads: int, num_kv_heads: int, size: int) -> tuple[int, int]:
    """(query heads, KV heads) held by each rank."""
    return num_heads // size, max(1, num_kv_heads // size)


def kv_head_start(num_kv_heads: int, rank: int, size: int) -> int:
    """The first KV head (of the full model) rank `rank` holds."""
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank // (size // num_kv_heads)  # replicated: ranks share a head in consecutive groups


def padded_vocab(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size) * size


def check_tensor_parallel(model_config, size: int, device: torch.device, torch_compile: bool) -> None:
    """Raise ValueError naming `tensor_parallel_size` when the model or the machine cannot take it."""
    if size == 1:
        return
    heads, kv_heads = model_config.num_heads, model_config.num_kv_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {heads} attention heads "
                         f"({model_config.name})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {kv_heads} KV heads, or "
                         f"be a multiple of them (KV heads are then replicated) ({model_config.name})")
    if model_config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's intermediate_size "
                         f"{model_config.intermediate_size} ({model_config.name})")
    if device.type == "cuda":
        first = device.index or 0
        available = torch.cuda.device_count()
        if first + size > available:
            raise ValueError(f"tensor_parallel_size {size} needs GPUs {first}..{first + size - 1}; "
                             f"this process sees {available} (CUDA_VISIBLE_DEVICES, or replicas.num_gpus "
                             f"in a serving config)")
    if torch_compile:
        raise ValueError("torch_compile is not supported with tensor_parallel_size > 1 "
                         "(the all-reduce inside the compiled regions is not traced); turn one off")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU after the one the engine was given (the CPU for all on the CPU)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


# ---- the group -------------------------------------------------------------------------------

def rendezvous_file() -> str:
    """A fresh path for the group's FileStore, in a directory only this user can enter."""
    return os.path.join(tempfile.mkdtemp(prefix="kvmesh-tp-"), "store")


def init_group(rank: int, size: int, rendezvous: str, device: torch.device) -> TensorParallel:
    """Join the group through the FileStore at `rendezvous` (rendezvous_file)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    if backend == "nccl":  # NVLink multicast (NVLS) stays off on the GPU machines (shared/device/README.md)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT, **kwargs)
    return TensorParallel(rank, size)


def min_over_ranks(value: int, tp: TensorParallel, device: torch.device) -> int:
    """The smallest of every rank's `value` (e.g. KV blocks: every rank must hold rank 0's ids)."""
    if tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
