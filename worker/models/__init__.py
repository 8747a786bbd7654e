"""The model-architecture registry: one line per architecture in `MODELS`, one file per model.

A checkpoint's Hugging Face config names its architecture (`architectures`, else `model_type`);
`model_class_for` looks it up here. The class (a DecoderForCausalLM) is also the architecture's config
adapter: `config_from_hf` builds the engine's ModelConfig with the switches it needs.
"""

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    model_type: str  # the Hugging Face `model_type`, for configs that name no architecture
    target: str  # "module:Class"


MODELS = {
    "LlamaForCausalLM": ModelEntry("llama", "kvmesh.worker.models.decoder:DecoderForCausalLM"),
    "Qwen2ForCausalLM": ModelEntry("qwen2", "kvmesh.worker.models.qwen2:Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ModelEntry("qwen3", "kvmesh.worker.models.qwen3:Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ModelEntry("qwen3_moe", "kvmesh.worker.models.qwen3_moe:Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ModelEntry("mixtral", "kvmesh.worker.models.mixtral:MixtralForCausalLM"),
}


def architecture_of(hf_config, name: str) -> str:
    """The registry key of a Hugging Face config; a ValueError listing the supported ones if none."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODELS:
            return arch
    model_type = getattr(hf_config, "model_type", None)
    for arch, entry in MODELS.items():
        if entry.model_type == model_type:
            return arch
    raise ValueError(f"model {name!r}: architecture {archs or model_type!r} is not supported; "
                     f"supported: {', '.join(MODELS)}")


def model_class_for(hf_config, name: str):
    """(registry key, model class) of a Hugging Face config."""
    arch = architecture_of(hf_config, name)
    module_name, _, cls_name = MODELS[arch].target.partition(":")
    return arch, getattr(importlib.import_module(module_name), cls_name)
