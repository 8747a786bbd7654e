"""Tensor-parallel layers (Megatron-LM's split, as vLLM's linear.py and vocab_parallel_embedding.py).

- ColumnParallelLinear: the output features split across ranks (no communication); a fused layer
  (gate_up) splits each of its parts, so every rank keeps whole [gate_r | up_r] pairs.
- QKVParallelLinear: q, k and v split by heads (KV heads replicated when there are fewer than ranks).
- RowParallelLinear: the input features split; the partial products are summed by an all-reduce.
- VocabParallelEmbedding / ParallelLMHead: the vocabulary (padded to a multiple of the ranks) split
  by rows; an embedding lookup is masked to the rank's rows and all-reduced, logits are gathered.

With one rank each is the plain layer (same parameter shapes and names as nn.Linear / nn.Embedding).
Each parameter carries a `weight_loader(param, full_tensor, shard=None)` that copies its rank's slice
of the full checkpoint tensor (the model's load_hf_weights calls it), so weights are sharded at load;
`full_shape` and `load_full(param, full_tensor)` (a fused layer's parts in one tensor) let random
weights be drawn at the full model's shapes, so every tensor-parallel size gets the same model.

The linear layers' `weight_scale` is None in the model dtype; with quantization="fp8" it is set after
loading, when the weight becomes float8_e4m3fn (layers/fp8.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.worker import tensor_parallel
from kvmesh.worker.layers.fp8 import fp8_linear
from kvmesh.worker.tensor_parallel import kv_head_start, local_heads, padded_vocab


def _attach(param: nn.Parameter, loader, full_shape: tuple[int, ...], load_full=None) -> None:
    param.weight_loader = loader
    param.full_shape = tuple(full_shape)
    param.load_full = load_full or (lambda p, tensor: loader(p, tensor, None, "random"))


def _linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight_scale is None:
        return F.linear(x, weight, bias)
    return fp8_linear(x, weight, weight_scale, bias)


def _check_shape(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's rows (output features) split; the rank's output is local."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 local_sizes: list[int] | None = None):
        super().__init__()
        self.tp = tensor_parallel.current()
        self.output_sizes = list(output_sizes)  # of the full layer, one per fused part
        self.local_sizes = local_sizes or [s // self.tp.size for s in output_sizes]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size))
        _attach(self.weight, self.load, (sum(output_sizes), input_size), self.load_parts)
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        if self.bias is not None:
            _attach(self.bias, self.load, (sum(output_sizes),), self.load_parts)
        self.register_buffer("weight_scale", None)  # [1, out] float32 once quantized to FP8 (one value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.weight_scale, self.bias)

    def load_parts(self, param: torch.Tensor, tensor: torch.Tensor) -> None:
        """The full layer's tensor, its fused parts stacked on dim 0."""
        for shard, part in enumerate(tensor.split(self.output_sizes, dim=0)):
            self.load(param, part, shard, "random")

    def part_slice(self, shard: int) -> tuple[int, int, int]:
        """(offset in the local parameter, start in the full part, rows) of part `shard`."""
        local = self.local_sizes[shard]
        return sum(self.local_sizes[:shard]), self.tp.rank * local, local

    @torch.no_grad()
    def load(self, param: torch.Tensor, tensor: torch.Tensor, shard: int | None = None, name: str = "") -> None:
        if shard is None:  # an unfused layer is one part
            if len(self.output_sizes) != 1:
                raise ValueError(f"model: weight {name!r} of a fused layer came without its part index")
            shard = 0
        offset, start, rows = self.part_slice(shard)
        if tensor.shape[0] != self.output_sizes[shard]:
            raise ValueError(f"model: weight {name!r} has {tensor.shape[0]} rows, "
                             f"expected {self.output_sizes[shard]}")
        target = param.narrow(0, offset, rows)
        source = tensor.narrow(0, start, rows)
        _check_shape(target, source, name)
        target.copy_(source.to(param.dtype))


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection split by heads: rank r holds query heads [r H/N, (r+1) H/N) and
    the KV heads they attend to (replicated when num_kv_heads < N)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        self.head_dim = head_dim
        self.total_kv_heads = num_kv_heads
        tp = tensor_parallel.current()
        self.num_local_heads, self.num_local_kv_heads = local_heads(num_heads, num_kv_heads, tp.size)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        q_local, kv_local = self.num_local_heads * head_dim, self.num_local_kv_heads * head_dim
        # a replicated KV head is whole on each rank that holds it
        super().__init__(hidden_size, [q, kv, kv], bias, local_sizes=[q_local, kv_local, kv_local])

    def part_slice(self, shard: int) -> tuple[int, int, int]:
        if shard == 0:
            return super().part_slice(0)
        offset = sum(self.local_sizes[:shard])
        start = kv_head_start(self.total_kv_heads, self.tp.rank, self.tp.size) * self.head_dim
        return offset, start, self.local_sizes[shard]


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split: each rank multiplies its slice of x, and
    the partial sums are all-reduced (the layer's only communication)."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.tp = tensor_parallel.current()
        self.input_size = input_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size // self.tp.size))
        _attach(self.weight, self.load, (output_size, input_size))
        self.register_buffer("weight_scale", None)  # [1, out] float32 once quantized to FP8 (one value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(_linear(x, self.weight, self.weight_scale))

    @torch.no_grad()
    def load(self, param: torch.Tensor, tensor: torch.Tensor, shard: int | None = None, name: str = "") -> None:
        if tensor.dim() != 2 or tensor.shape[1] != self.input_size:
            raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected ({param.shape[0]}, {self.input_size})")
        cols = param.shape[1]
        source = tensor.narrow(1, self.tp.rank * cols, cols)
        _check_shape(param, source, name)
        param.copy_(source.to(param.dtype))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by token id: rank r holds ids [r V'/N, (r+1) V'/N) of the padded
    vocabulary V'; a lookup outside the rank's rows gives zeros, and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = tensor_parallel.current()
        self.vocab_size = vocab_size
        self.rows_per_rank = padded_vocab(vocab_size, self.tp.size) // self.tp.size
        self.vocab_start = self.tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        _attach(self.weight, self.load, (vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(torch.where(inside, local, 0), self.weight)  # [T, hidden]
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)

    @torch.no_grad()
    def load(self, param: torch.Tensor, tensor: torch.Tensor, shard: int | None = None, name: str = "") -> None:
        if tensor.dim() != 2 or tensor.shape[0] != self.vocab_size or tensor.shape[1] != param.shape[1]:
            raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected ({self.vocab_size}, {param.shape[1]})")
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        param.zero_()  # the padding rows
        param.narrow(0, 0, rows).copy_(tensor.narrow(0, self.vocab_start, rows).to(param.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection split like the embedding (so tied weights are the same shard); logits
    are gathered from every rank and cut to the real vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)  # [N, V'/ranks]
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[..., :self.vocab_size]  # [N, vocab]
