import os

import torch


def use_kernels(x: torch.Tensor) -> bool:
    """Whether a layer runs its hand-fused Triton kernel (kvmesh.kernels) on `x`: on a GPU, unless
    torch.compile is tracing it, where the plain torch form lets inductor fuse it with its neighbours
    (worker/compile.py)."""
    return x.is_cuda and not torch.compiler.is_compiling()


# Whether the residual add joins its RMSNorm, and Qwen3's q / k norms join the rotation, in one launch
# each (the same bits as the separate kernels); KVMESH_FUSED_NORMS=0 keeps them apart (A/B runs). Read
# once: the layers ask at every call.
FUSE_NORMS = os.environ.get("KVMESH_FUSED_NORMS", "1") != "0"

# Whether the rotation writes the step's K / V straight into the paged KV cache (one launch instead of
# the rotation's and the backend's store; the same bytes); KVMESH_FUSED_KV_STORE=0 keeps them apart.
FUSE_KV_STORE = os.environ.get("KVMESH_FUSED_KV_STORE", "1") != "0"


def _tokens(variable: str, default: str) -> int:
    value = os.environ.get(variable, default)
    if not value.isdigit():
        raise ValueError(f"{variable} must be a whole number of tokens (0: off), got {value!r}")
    return int(value)


# Decode steps of at most this many tokens run each layer's residual add + RMSNorm with the GEMM after
# it in one launch, SiLU-and-mul included for gate_up (kvmesh.kernels.norm_gemm: within the bf16 band
# of the separate kernels, not bit for bit). 0, the default: never, until a GPU run shows it pays
# (PERF.md, "What limits it"). Read once.
NORM_GEMM_MAX_TOKENS = _tokens("KVMESH_NORM_GEMM_MAX_TOKENS", "0")
# Where the norm joins the qkv GEMM and the rotation writes K / V into the cache (FUSE_KV_STORE), the
# GEMM's launch also norms Qwen3's q / k heads, rotates them and stores K / V
# (kvmesh.kernels.norm_gemm.norm_qkv_rotate_store): one launch up to the attention. 0: the rotation
# stays its own launch (A/B runs).
NORM_GEMM_ROTATE = os.environ.get("KVMESH_NORM_GEMM_ROTATE", "1") != "0"
