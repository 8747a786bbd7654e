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
