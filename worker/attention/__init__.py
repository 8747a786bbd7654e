"""Attention backends, chosen automatically (flashinfer, else flash_attn, else triton on a GPU;
torch on the CPU) or by name with `attention_backend=`."""

import importlib

import torch

from kvmesh.worker.attention.base import AttentionBackend

# name -> "module:Class"; GPU backends are imported only when chosen.
BACKENDS = {
    "torch": "kvmesh.worker.attention.torch_backend:TorchAttentionBackend",
    "triton": "kvmesh.worker.attention.triton_backend:TritonAttentionBackend",
    "flashinfer": "kvmesh.worker.attention.flashinfer_backend:FlashInferAttentionBackend",
    "flash_attn": "kvmesh.worker.attention.flash_attn_backend:FlashAttnBackend",
}
GPU_PREFERENCE = ("flashinfer", "flash_attn", "triton")


def load_backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
    module_name, cls_name = BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"attention_backend {name!r} is not available here: {e}") from e
    return getattr(module, cls_name)


def select_backend(name: str, device: torch.device, block_size: int) -> type[AttentionBackend]:
    if name != "auto":
        if name != "torch" and device.type != "cuda":
            raise ValueError(f"attention_backend {name!r} needs a CUDA device; use 'torch' on the CPU")
        return load_backend_class(name)
    if device.type != "cuda":
        return load_backend_class("torch")
    for candidate in GPU_PREFERENCE:
        try:
            cls = load_backend_class(candidate)
        except (ValueError, AttributeError):
            continue
        if getattr(cls, "supports_block_size", lambda b: True)(block_size):
            return cls
    return load_backend_class("torch")
