"""Mixtral: the Llama decoder with a sparse MoE MLP in every layer (experts of `intermediate_size`),
top-k scores always renormalised."""

import dataclasses

from kvmesh.worker.model_config import ModelConfig, MoEConfig
from kvmesh.worker.models.moe_decoder import MoEDecoderForCausalLM


class MixtralForCausalLM(MoEDecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config, name: str, arch: str) -> ModelConfig:
        moe = MoEConfig(num_experts=hf_config.num_local_experts, num_experts_per_tok=hf_config.num_experts_per_tok,
                        expert_intermediate_size=hf_config.intermediate_size, norm_topk_prob=True,
                        sparse_layers=tuple(range(hf_config.num_hidden_layers)))
        return dataclasses.replace(super().config_from_hf(hf_config, name, arch), moe=moe)
