"""torch.compile for the decoder's work outside attention (engine option `torch_compile`).

Each layer runs two regions around the attention backend: before it (residual add, input RMSNorm,
qkv projection, Qwen3's q/k RMSNorm, rotary) and after it (o projection, residual add, RMSNorm,
gate/up projection, SiLU-and-mul, down projection). Compiled, inductor fuses each run of elementwise
work between the GEMMs into one kernel: the residual add with the norm that follows it, q/k norm
with rotary, where the hand-fused Triton kernels (kvmesh.kernels) keep them apart. The attention
call stays outside the compiled code (its backend plans on the host and writes the KV cache), so the
regions are pure tensor functions; decode still runs under the engine's own CUDA graphs, captured
after the compiled code is warmed up.

The regions are compiled with dynamic shapes (the token count varies per step): one graph serves
every layer and every batch size, plus the variants dynamo specialises (the first layer, which has
no residual yet, and single-token steps).

Measured on an H200 (docs/PERF.md "torch.compile"): no faster than the hand-fused kernels under
the CUDA graphs (offline within noise, TPOT +4%), and a 1024-token eager prefill 2.3x slower; on
the CPU no faster either. Hence off by default.
"""

import torch


def compile_layers(model) -> None:
    """Replace each layer's regions with compiled ones (in place; compilation happens on first use)."""
    # every layer runs the same code: let its compiled graphs be reused across the 28+ instances
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in model.model.layers:
        layer.before_attention = torch.compile(layer.before_attention, dynamic=True, fullgraph=True)
        layer.after_attention = torch.compile(layer.after_attention, dynamic=True, fullgraph=True)
