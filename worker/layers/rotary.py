"""Rotary position embedding (neox / rotate-half layout, as Hugging Face Llama and Qwen)."""

import torch
from torch import nn

from kvmesh.worker.layers.kernels import use_kernels


def rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


UNSUPPORTED_ROPE = {"dynamic": "its frequencies depend on the sequence length"}


def check_rope(hf_config, name: str) -> None:
    """A ValueError naming the field when the config's RoPE type is one we cannot compute."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope_parameters(hf_config)["rope_type"]
    if rope_type == "default":
        return
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type in UNSUPPORTED_ROPE:
        why = UNSUPPORTED_ROPE.get(rope_type, "unknown rope type")
        supported = ["default"] + sorted(t for t in ROPE_INIT_FUNCTIONS if t not in UNSUPPORTED_ROPE)
        # hub configs hold it in rope_scaling; transformers 5 saves it as rope_parameters
        raise ValueError(f"model {name!r}: config.json rope_scaling.rope_type (rope_parameters.rope_type) "
                         f"{rope_type!r} is not supported ({why}); supported: {', '.join(supported)}")


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2], attention scaling) for the config's rope type."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    # Scaled variants (linear, llama3, yarn, ...): transformers' own initialisers, so the
    # frequencies match the reference model bit for bit.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    check_rope(hf_config, getattr(hf_config, "_name_or_path", "") or "?")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        self.register_buffer("cos", (freqs.cos() * scaling), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if use_kernels(q):  # q and k in one fused launch (kvmesh.kernels.rotary: same arithmetic)
            from kvmesh.kernels.rotary import apply_rotary
            return apply_rotary(positions, q, k, self.cos, self.sin)
        # positions [T]; q [T, H, D]; k [T, Hkv, D]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
