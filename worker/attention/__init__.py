"""Attention backends, one file each, listed with their capabilities in `registry.BACKENDS`; chosen
by name with `attention_backend=`, or automatically (`auto`: the first in registry order that runs
here and supports the block size, head dim, dtype and KV-cache dtype)."""

import importlib

import torch

from kvmesh.worker.attention.base import AttentionBackend
from kvmesh.worker.attention.registry import BACKENDS, backend_spec, choose_backend, dtype_name


def load_backend_class(name: str) -> type[AttentionBackend]:
    module_name, _, cls_name = backend_spec(name).target.partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


def select_backend(name: str, device: torch.device, block_size: int, head_dim: int,
                   dtype: torch.dtype, kv_cache_dtype: str = "auto") -> type[AttentionBackend]:
    return load_backend_class(choose_backend(name, device.type, block_size, head_dim, dtype_name(dtype),
                                             kv_cache_dtype))


__all__ = ["BACKENDS", "AttentionBackend", "load_backend_class", "select_backend"]
