"""The hardware floor of a run: the least time the bytes and FLOPs of its steps allow.

Measured in the same run: copy bandwidth (a large device-to-device copy, bytes read + written) and
matmul rate (a large bf16 product on random data). Per engine step the bytes that must move are the
weights once, each running sequence's cached KV once, and the step's new KV written; the FLOPs are
2 x matmul params per token, the logits of the sampled rows, and causal attention. A step costs at
least max(bytes / bandwidth, FLOPs / rate); the floor is the sum over the steps the run took.
"""

import time
from dataclasses import dataclass

import torch


def _timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (bytes/s, read + written) and bf16 matmul rate (FLOP/s) of this device."""
    on_gpu = device.type == "cuda"
    copy_elems = (1 << 29) if on_gpu else (1 << 22)  # 1 GiB of bf16 on a GPU: far past the L2
    src = torch.randn(copy_elems, device=device, dtype=torch.bfloat16 if on_gpu else torch.float32)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), device, 20 if on_gpu else 5)
    n = 8192 if on_gpu else 256
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = _timed(lambda: torch.mm(a, b), device, 20 if on_gpu else 5)
    del src, dst, a, b
    return {"copy_bytes_per_s": 2 * copy_elems * (2 if on_gpu else 4) / copy_s,
            "matmul_flops_per_s": 2 * n ** 3 / mm_s}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype_bytes: int = 2
    # mixture of experts: in `num_sparse_layers` of the layers the MLP is `num_experts` experts of
    # width `expert_intermediate_size`, of which each token runs `experts_per_token`
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    num_sparse_layers: int = 0
    kv_dtype_bytes: int | None = None  # the KV cache's element size (1 for FP8); None: dtype_bytes

    @property
    def attention_params(self) -> int:
        return self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)  # q, o, k, v

    @property
    def layer_params(self) -> int:
        """A dense layer's weights."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def matmul_params(self) -> int:
        """Weights each token multiplies through (no embedding lookup, no norms, no lm_head); in a
        sparse layer the router and the token's experts only."""
        sparse = self.attention_params + self.hidden_size * self.num_experts + self.experts_per_token * self.expert_params
        return (self.num_layers - self.num_sparse_layers) * self.layer_params + self.num_sparse_layers * sparse

    @property
    def weight_bytes(self) -> int:
        """Weights a step must read: the layers and the lm_head (the embedding too when tied: same matrix)."""
        return self.weight_bytes_for(1 << 62)

    def weight_bytes_for(self, num_tokens: int) -> int:
        """Weights a step of `num_tokens` tokens must read: a sparse layer's experts only those its
        tokens are routed to, counted as the expected number of distinct experts under uniform routing,
        E * (1 - (1 - k/E)^n) (random weights route about uniformly; trained ones less so)."""
        params = (self.num_layers - self.num_sparse_layers) * self.layer_params + self.vocab_size * self.hidden_size
        if self.num_sparse_layers:
            touched = self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts) ** num_tokens)
            params += self.num_sparse_layers * (self.attention_params + self.hidden_size * self.num_experts
                                                + round(touched * self.expert_params))
        return params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        kv_bytes = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * kv_bytes


class FloorCounter:
    """Accumulates max(bytes / bandwidth, FLOPs / rate) over engine steps."""

    def __init__(self, shape: ModelShape, copy_bytes_per_s: float, matmul_flops_per_s: float):
        self.shape = shape
        self.bandwidth = copy_bytes_per_s
        self.rate = matmul_flops_per_s
        self.seconds = 0.0
        self.bytes = 0
        self.flops = 0
        self.steps = 0

    def add_step(self, query_lens: list[int], seq_lens: list[int], num_sampled: int) -> None:
        """One step: sequence i computes query_lens[i] new tokens ending at context seq_lens[i]."""
        s = self.shape
        new_tokens = sum(query_lens)
        cached_tokens = sum(c - q for q, c in zip(query_lens, seq_lens))
        step_bytes = s.weight_bytes_for(new_tokens) + (cached_tokens + new_tokens) * s.kv_bytes_per_token
        # attention: QK^T and PV, 2 FLOPs per multiply-add each; new token i of a chunk sees c - q + i + 1 keys
        attn_pairs = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(query_lens, seq_lens))
        step_flops = (2 * s.matmul_params * new_tokens + 2 * s.vocab_size * s.hidden_size * num_sampled
                      + 4 * s.num_layers * s.num_heads * s.head_dim * attn_pairs)
        self.bytes += step_bytes
        self.flops += step_flops
        self.seconds += max(step_bytes / self.bandwidth, step_flops / self.rate)
        self.steps += 1
