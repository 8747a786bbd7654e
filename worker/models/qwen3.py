"""Qwen3: the shared decoder with a per-head RMSNorm on q and k before RoPE."""

import dataclasses

from kvmesh.worker.model_config import ModelConfig
from kvmesh.worker.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config, name: str, arch: str) -> ModelConfig:
        return dataclasses.replace(super().config_from_hf(hf_config, name, arch), qk_norm=True)
