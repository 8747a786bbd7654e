import torch
from torch import nn

from kvmesh.worker.layers.kernels import FUSE_NORMS, use_kernels


class RMSNorm(nn.Module):
    """RMSNorm; given the residual stream, first adds `x` to it (vLLM's fused-add form): returns
    (norm(x + residual), x + residual). Under torch.compile the add and the norm become one kernel."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        if (use_kernels(x) and FUSE_NORMS and x.dim() == 2 and x.is_contiguous()
                and residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype):
            from kvmesh.kernels.rms_norm import add_rms_norm  # one launch instead of two, the same bits
            return add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):  # one fused launch instead of ~7 (kvmesh.kernels.rms_norm: same rounding)
            from kvmesh.kernels.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)  # as transformers: scale after the cast back
