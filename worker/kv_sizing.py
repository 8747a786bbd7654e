"""How many KV blocks a worker's pool holds (the same number on every tensor-parallel rank)."""

import torch

from kvmesh.config import EngineConfig
from kvmesh.worker.model_config import ModelConfig
from kvmesh.worker.tensor_parallel import TensorParallel, local_heads, min_over_ranks

CPU_DEFAULT_KV_BYTES = 256 * 1024 * 1024


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                  kv_cache_dtype: torch.dtype, tp: TensorParallel) -> int:
    """Blocks that fit this rank's budget (its KV heads only), the least over the ranks: rank 0's
    block ids must exist in every rank's pool. kv_cache_dtype: the pool's element type (1 byte for
    an FP8 cache: twice the blocks of bf16)."""
    elem = torch.tensor([], dtype=kv_cache_dtype).element_size()
    _, num_kv_heads = local_heads(model_config.num_heads, model_config.num_kv_heads, tp.size)
    bytes_per_token = 2 * model_config.num_layers * num_kv_heads * model_config.head_dim
    bytes_per_block = bytes_per_token * elem * config.block_size
    budget = config.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            # keep headroom for activations of the largest step (logits dominate)
            activations = config.max_num_batched_tokens * (
                model_config.hidden_size * 16 + model_config.vocab_size // 4) * 4
            budget = int(total * config.gpu_memory_utilization) - used - activations
        else:
            budget = CPU_DEFAULT_KV_BYTES
    blocks = min_over_ranks(int(budget // bytes_per_block), tp, device)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes: {budget} bytes hold no KV block "
                         f"(one block of {config.block_size} tokens needs {bytes_per_block} bytes)")
    return blocks
