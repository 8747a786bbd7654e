"""Configuration contracts.

EngineConfig: the engine arguments of one worker (frozen, validated; the same names as the `LLM`
keywords). The serving config (YAML, validated) builds on it in kvmesh/serve_config.py.
"""

import dataclasses
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer", "flash_attn")
# vLLM's names: "auto" stores K/V in the model dtype; "fp8" is an alias of "fp8_e4m3"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = (None, "fp8")
# vLLM's --scheduling-policy: "fcfs" queues by arrival; "priority" by each request's `priority`
# (lower first), then arrival, and preempts the lowest priority first (worker/scheduler.py)
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (float32 on the CPU, bfloat16 on a GPU) | "float32" | "bfloat16" | "float16"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's context length
    kv_cache_memory_bytes: int | None = None  # default on the CPU: 256 MiB
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    # "auto": the model dtype; "fp8" / "fp8_e4m3": float8_e4m3fn with a per-layer K and V scale
    # (1.0, vLLM's default without calibrated scales), half the bytes of bf16 per token
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs
    # torch.compile the layers' work outside attention (worker/compile.py); compiles on first use
    torch_compile: bool = False
    # Launch step N+1 before step N's tokens reach the host (the GPU never waits on Python).
    # None: on for CUDA, off on the CPU (where launches are synchronous and it only adds latency).
    async_scheduling: bool | None = None
    seed: int = 0
    worker_id: str = "worker-0"
    # Ranks (GPUs, or CPU processes) one engine's model is split over by heads (worker/tensor_parallel.py)
    tensor_parallel_size: int = 1
    # None: weights in `dtype`; "fp8": the linear layers' weights quantized to FP8 (e4m3, one scale
    # per tensor) at load, activations per token at each call (worker/layers/fp8.py), as vLLM's
    quantization: str | None = None
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        def fail(name, limit):
            raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")

        if not isinstance(self.model, str) or not self.model:
            fail("model", "a non-empty string")
        if not _is_int(self.block_size) or not 1 <= self.block_size <= 1024:
            fail("block_size", "an integer in [1, 1024]")
        if not _is_int(self.max_num_batched_tokens) or self.max_num_batched_tokens < 1:
            fail("max_num_batched_tokens", ">= 1")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            fail("max_num_seqs", ">= 1")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            fail("max_model_len", ">= 1")
        if self.kv_cache_memory_bytes is not None and (
                not _is_int(self.kv_cache_memory_bytes) or self.kv_cache_memory_bytes < 1):
            fail("kv_cache_memory_bytes", ">= 1")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            fail("gpu_memory_utilization", "in (0, 1]")
        if self.attention_backend not in ATTENTION_BACKENDS:
            fail("attention_backend", f"one of {', '.join(ATTENTION_BACKENDS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fail("kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}")
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            fail("tensor_parallel_size", "an integer >= 1")
        if self.quantization not in QUANTIZATIONS:
            fail("quantization", "None or 'fp8'")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            fail("scheduling_policy", f"one of {', '.join(SCHEDULING_POLICIES)}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            fail("dtype", "one of auto, float32, bfloat16, float16")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            fail("device", "auto, cpu, cuda or cuda:N")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
