import torch


def use_kernels(x: torch.Tensor) -> bool:
    """Whether a layer runs its hand-fused Triton kernel (kvmesh.kernels) on `x`: on a GPU, unless
    torch.compile is tracing it, where the plain torch form lets inductor fuse it with its neighbours
    (worker/compile.py)."""
    return x.is_cuda and not torch.compiler.is_compiling()
