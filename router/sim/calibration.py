"""Step-time model of one worker: an H200 serving the Qwen3-0.6B shape (defaults).

An engine step runs `num_decode` decode tokens and `num_prefill` prompt tokens (chunked prefill) in
one forward pass. Its time is a roofline plus a fixed overhead:

    memory  = (weight bytes + KV bytes read) / (copy bandwidth * bandwidth_efficiency)
    compute = (2 * params * tokens + attention FLOPs) / (matmul rate * matmul_efficiency)
    step    = overhead + max(memory, compute)

Measured ceilings (../shared/device/README.md, 2026-11-30): copy 4.23 TB/s, bf16 matmul
789 TFLOP/s; flashinfer paged decode read KV at 90% of copy bandwidth, paged prefill ran at
392 TFLOP/s (50% of the matmul rate), hence the two efficiencies.
"""

from dataclasses import dataclass, field

from kvmesh.worker.presets import PRESETS


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2  # bf16

    @classmethod
    def of_preset(cls, name: str) -> "ModelShape":
        """The shape of a random-weight model preset (kvmesh.worker.presets), as the engine runs it."""
        config = PRESETS[name]
        return cls(name, config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
                   config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
                   config["vocab_size"])

    @property
    def layer_params(self) -> int:
        q = self.hidden_size * self.num_q_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_q_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q + kv + o + mlp

    @property
    def body_params(self) -> int:
        """Parameters every token goes through (not the embedding lookup or the LM head)."""
        return self.num_layers * self.layer_params

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size  # tied with the embedding

    @property
    def weight_bytes(self) -> int:
        return (self.body_params + self.head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes  # 114,688


@dataclass(frozen=True)
class Hardware:
    name: str = "h200"
    memory_bytes: int = 139 * 2**30
    copy_bandwidth: float = 4.23e12  # B/s, device-to-device copy, measured
    matmul_flops: float = 789e12  # bf16, measured
    bandwidth_efficiency: float = 0.9  # flashinfer paged decode reached 3.81 of 4.23 TB/s
    matmul_efficiency: float = 0.5  # flashinfer paged prefill reached 392 of 789 TFLOP/s
    step_overhead_s: float = 0.5e-3  # scheduling + launch (CUDA graphs for decode)
    memory_utilization: float = 0.9
    activation_reserve_bytes: int = 2 * 2**30


@dataclass(frozen=True)
class CostModel:
    model: ModelShape = field(default_factory=lambda: ModelShape.of_preset("qwen3-0.6b"))
    hardware: Hardware = field(default_factory=Hardware)
    block_size: int = 16

    def kv_capacity_blocks(self) -> int:
        """Blocks that fit after the weights and an activation reserve (the engine's sizing rule)."""
        hw, m = self.hardware, self.model
        free = hw.memory_bytes * hw.memory_utilization - m.weight_bytes - hw.activation_reserve_bytes
        return int(free // (m.kv_bytes_per_token * self.block_size))

    def step_time(self, num_decode: int, decode_context_tokens: int, num_prefill: int,
                  prefill_attention_pairs: float, num_sampled: int) -> float:
        """Seconds for one step. `decode_context_tokens`: KV tokens the decodes read;
        `prefill_attention_pairs`: sum over prompt tokens of the positions each attends to;
        `num_sampled`: tokens that go through the LM head (decodes + prompts that finish)."""
        m, hw = self.model, self.hardware
        if num_decode == 0 and num_prefill == 0:
            return 0.0
        kv_read = (decode_context_tokens + num_prefill) * m.kv_bytes_per_token
        memory = (m.weight_bytes + kv_read) / (hw.copy_bandwidth * hw.bandwidth_efficiency)
        attention = 4.0 * m.num_layers * m.num_q_heads * m.head_dim * (
            prefill_attention_pairs + decode_context_tokens)
        flops = 2.0 * (m.body_params * (num_decode + num_prefill) + m.head_params * num_sampled) + attention
        compute = flops / (hw.matmul_flops * hw.matmul_efficiency)
        return hw.step_overhead_s + max(memory, compute)

    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        return self.step_time(batch, context_tokens, 0, 0.0, batch)

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prompt's prefill alone (no decodes), ignoring chunking."""
        pairs = new_tokens * (cached_tokens + (new_tokens + 1) / 2)
        return self.step_time(0, 0, new_tokens, pairs, 1)
