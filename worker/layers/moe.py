"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral.

A router (a linear layer, `gate`) scores every expert for each token; softmax in float32, the top
k experts, optionally renormalised so their weights sum to 1 (transformers' Qwen3MoeTopKRouter and
MixtralTopKRouter). Each chosen expert is a SiLU-gated MLP; the token's output is the weighted sum of
its experts' outputs.

The experts' weights are stacked as transformers 5 holds them (`experts.gate_up_proj`
[E, 2 * I, H], `experts.down_proj` [E, H, I]), which is also what the fused Triton kernel
(kvmesh.kernels.fused_moe) reads. Checkpoints that store one tensor per expert are stacked on load
(worker/models/moe_decoder.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.worker.model_config import MoEConfig


class Experts(nn.Module):
    def __init__(self, moe: MoEConfig, hidden_size: int):
        super().__init__()
        experts, inter = moe.num_experts, moe.expert_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden_size, inter))


class SparseMoE(nn.Module):
    def __init__(self, moe: MoEConfig, hidden_size: int):
        super().__init__()
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe, hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of each token."""
        router_logits = self.gate(x)  # [T, E]
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.route(x)
        return moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, expert_ids)


# An opaque op to torch.compile (worker/compile.py compiles each layer's MLP region whole, with dynamic
# shapes): the routing around it compiles, the experts' data-dependent loop or kernel launch does not.
@torch.library.custom_op("kvmesh::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights, expert_ids [T, k] -> [T, H]."""
    if x.is_cuda:  # the fused kernel is shape-static (CUDA-graph safe); the loop below is not
        from kvmesh.kernels.fused_moe import fused_moe
        return fused_moe(x, gate_up, down, weights, expert_ids)
    return moe_reference(x, gate_up, down, weights, expert_ids)


@moe_experts.register_fake
def _(x, gate_up, down, weights, expert_ids):
    return torch.empty_like(x)


def moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor) -> torch.Tensor:
    """The torch path (CPU, and the kernel's reference in tests): each expert that any token chose
    runs on its tokens, as transformers' Qwen3MoeExperts does.
    x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights, expert_ids [T, k] -> [T, H]."""
    out = torch.zeros_like(x)
    inter = down.shape[-1]
    for expert in torch.unique(expert_ids).tolist():
        token_idx, slot = torch.where(expert_ids == expert)
        gate, up = F.linear(x[token_idx], gate_up[expert]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])  # [n, H]
        out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(out.dtype))
    return out
