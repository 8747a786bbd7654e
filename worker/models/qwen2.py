"""Qwen2: the shared decoder with biases on the q/k/v projections."""

import dataclasses

from kvmesh.worker.model_config import ModelConfig
from kvmesh.worker.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config, name: str, arch: str) -> ModelConfig:
        return dataclasses.replace(super().config_from_hf(hf_config, name, arch), qkv_bias=True)
