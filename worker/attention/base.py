"""The attention backend interface and the per-step metadata every backend reads.

KV cache layout (all backends): per layer, k_cache and v_cache of shape
[num_blocks, block_size, num_kv_heads, head_dim] (flash-attn's paged layout, flashinfer's NHD), in
the model dtype or, with kv_cache_dtype fp8, float8_e4m3fn holding K / k_scale and V / v_scale
(per-layer scales, worker/kv_cache.py): backends quantize on store and dequantize on read.
A token's slot is block_id * block_size + offset_in_block.

One forward step covers a flat batch of T new tokens from S sequences, mixing decodes (one new
token) and prompt chunks (many, possibly after a cached or previously computed prefix). Sequence i
owns new tokens query_start_loc[i]:query_start_loc[i+1]; its context after this step is
seq_lens[i] tokens, of which the first seq_lens[i] - query_lens[i] were already in the cache.
Attention is causal over the whole context.
"""

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import InitVar, dataclass, field
from typing import Callable, ClassVar

import torch

from kvmesh.worker.attention.registry import check_supported, dtype_name
from kvmesh.worker.kv_cache import is_fp8, kv_cache_torch_dtype
from kvmesh.worker.scoped_context import scoped


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [S + 1] int32, on device (cu_seqlens_q)
    seq_lens: torch.Tensor  # [S] int32, on device: context length including this step's tokens
    block_tables: torch.Tensor  # [S, max_blocks_per_seq] int32, on device, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, on device: where each new token's K/V is written
    query_lens_cpu: list[int]  # [S]
    seq_lens_cpu: list[int]  # [S]
    max_query_len: int
    max_seq_len: int
    num_decode_tokens: int = 0  # sequences are ordered decodes first; these have query_len 1
    extra: dict = field(default_factory=dict)  # backend-private state built in plan()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(eq=False)  # one object per model runner: compared by identity
class AttentionBackend(ABC):
    """One object per model runner; `plan` runs once per step, `forward` once per layer.

    `name` is the backend's key in the registry (registry.BACKENDS), whose limits it is checked
    against when built; then `setup` imports the backend's kernels and builds its buffers."""

    name: ClassVar[str] = "abstract"
    # the K/V store kernel, store_kvcache's signature (k, v, k_cache, v_cache, slot_mapping, k_scale,
    # v_scale): set by the class or by setup()
    _store: ClassVar[Callable[..., None]]

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    scale: float
    device: torch.device
    dtype: torch.dtype
    # the config's name ("auto", "fp8"); once built, the attribute is the pool's element type
    kv_cache_dtype: InitVar[str] = "auto"

    def __post_init__(self, kv_cache_dtype: str) -> None:
        check_supported(self.name, self.block_size, self.head_dim, dtype_name(self.dtype), kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, self.dtype)
        self.fp8_kv = is_fp8(self.kv_cache_dtype)
        self.setup()

    def setup(self) -> None:
        """Import the kernels (optional GPU libraries: imported here, not with the module) and build
        the buffers the backend keeps."""

    def plan(self, metadata: AttentionMetadata) -> None:
        """Per-step preparation shared by all layers (index buffers, kernel plans)."""

    def store(self, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
              v_cache: torch.Tensor, metadata: AttentionMetadata, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        """Write the step's K/V ([T, Hkv, D]) into the caches at metadata.slot_mapping (slot -1
        skipped; into an FP8 cache as K / k_scale, V / v_scale) with the backend's `_store` kernel,
        which setup() picks; k = v = None: kvmesh.kernels.rotary.rotate_and_store already did."""
        if k is not None:
            self._store(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """`store` k, v ([T, Hkv, D]) (k = v = None: already in the caches), then attend.

        q: [T, H, D]. Returns [T, H, D]. k_scale / v_scale: the layer's FP8 scales (unused when
        the cache is in the model dtype).
        """


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    kv_scales: list[tuple[float, float]] | None = None  # per layer (k_scale, v_scale); None: 1.0

    def kv_scale(self, layer_idx: int) -> tuple[float, float]:
        return self.kv_scales[layer_idx] if self.kv_scales is not None else (1.0, 1.0)


_forward_context: ContextVar[ForwardContext | None] = ContextVar("kvmesh_forward_context", default=None)


def forward_context(ctx: ForwardContext) -> AbstractContextManager[ForwardContext]:
    """Scope the step's attention metadata to one model forward (no bare module global)."""
    return scoped(_forward_context, ctx)


def get_forward_context() -> ForwardContext:
    ctx = _forward_context.get()
    if ctx is None:
        raise RuntimeError("attention called outside forward_context()")
    return ctx
