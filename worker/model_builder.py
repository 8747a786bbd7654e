"""Build a model from a --model value: its class from the model registry (kvmesh.worker.models) by the
architecture its config names, weights from safetensors (or random for presets), tokenizer and EOS
ids."""

import json
from dataclasses import dataclass

import torch

from kvmesh.worker.layers.fp8 import check_quantization, quantize_linear_weights
from kvmesh.worker.loader import (ModelSource, iter_safetensors, load_hf_config, load_tokenizer_for,
                                  resolve_model)
from kvmesh.worker.model_config import ModelConfig
from kvmesh.worker.models import model_class_for
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.tensor_parallel import SINGLE, TensorParallel, building_with

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: DecoderForCausalLM
    config: ModelConfig
    tokenizer: object
    name: str
    eos_token_ids: list[int]
    path: object = None  # the Hugging Face directory it was loaded from (None for presets)


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available here; use device='cpu'")
    dev = torch.device(device)
    if dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, DTYPES[dtype]


def model_config_for(model: str) -> ModelConfig:
    """The engine's ModelConfig of a --model value, without building the model."""
    return model_config_of(resolve_model(model))


def model_config_of(source: ModelSource) -> ModelConfig:
    """The engine's ModelConfig of a resolved model: its architecture looked up and its config
    adapted, with every refusal of what the engine cannot do (ValueError naming the field)."""
    hf_config = load_hf_config(source)
    arch, model_class = model_class_for(hf_config, source.name)
    return model_class.config_from_hf(hf_config, source.name, arch)


def build_model(model: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                progress: bool = False, tp: TensorParallel = SINGLE,
                quantization: str | None = None) -> LoadedModel:
    """The model (this rank's shard of it under tensor parallelism: `tp`), its config and tokenizer;
    with quantization="fp8" the linear layers' weights (the rank's shards) become FP8 after loading."""
    source = resolve_model(model)
    hf_config = load_hf_config(source)
    arch, model_class = model_class_for(hf_config, source.name)
    config = model_class.config_from_hf(hf_config, source.name, arch)
    check_quantization(quantization, device, moe=config.moe is not None)
    tokenizer = load_tokenizer_for(source)
    with torch.device(device), building_with(tp):
        net = model_class(config, config.max_position_embeddings)
    if source.preset is not None:
        init_random_weights(net, seed)
    else:
        weights = iter_safetensors(source.path)
        if progress:
            from tqdm import tqdm

            weights = tqdm(weights, desc=f"loading {source.name}", unit=" tensors", leave=False)
        net.load_hf_weights(weights)
    for param in net.parameters():  # RoPE tables stay float32 (they are buffers)
        param.data = param.data.to(dtype)
    if quantization == "fp8":
        quantize_linear_weights(net)
        if device.type == "cuda":  # the bf16 weights' blocks, so the KV pool's sizing sees them free
            torch.cuda.empty_cache()
    net.eval()
    return LoadedModel(net, config, tokenizer, source.name, eos_ids(config, tokenizer, source), source.path)


@torch.no_grad()
def init_random_weights(net: torch.nn.Module, seed: int) -> None:
    """Draw each parameter at the full model's shape and keep this rank's slice (the parallel
    layers' `load_full`), so a model is the same whatever its tensor-parallel size."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in net.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        # weights and biases alike
        full = torch.randn(getattr(param, "full_shape", param.shape), generator=generator) * 0.02
        load_full = getattr(param, "load_full", None)
        if load_full is None:
            param.copy_(full)
        else:
            load_full(param, full)


def eos_ids(config: ModelConfig, tokenizer, source) -> list[int]:
    ids = list(config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    if source.path is not None and (source.path / "generation_config.json").is_file():
        eos = json.loads((source.path / "generation_config.json").read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(set(ids))
