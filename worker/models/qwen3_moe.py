"""Qwen3-MoE: Qwen3 (q/k RMSNorm) with sparse MoE MLPs; `decoder_sparse_step` and `mlp_only_layers`
pick the sparse layers, `norm_topk_prob` whether the top-k scores are renormalised."""

import dataclasses

from kvmesh.worker.model_config import ModelConfig, MoEConfig
from kvmesh.worker.models.moe_decoder import MoEDecoderForCausalLM


class Qwen3MoeForCausalLM(MoEDecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config, name: str, arch: str) -> ModelConfig:
        num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        sparse = tuple(i for i in range(hf_config.num_hidden_layers)
                       if num_experts > 0 and i not in dense and (i + 1) % step == 0)
        moe = MoEConfig(num_experts=num_experts, num_experts_per_tok=hf_config.num_experts_per_tok,
                        expert_intermediate_size=hf_config.moe_intermediate_size,
                        norm_topk_prob=bool(hf_config.norm_topk_prob), sparse_layers=sparse)
        return dataclasses.replace(super().config_from_hf(hf_config, name, arch), qk_norm=True, moe=moe)
