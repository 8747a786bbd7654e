"""The shared decoder with a sparse mixture-of-experts MLP (worker/layers/moe.py) in the layers its
MoEConfig names: the base of Qwen3-MoE (qwen3_moe.py) and Mixtral (mixtral.py).

Checkpoints store each expert's projections as separate tensors (`mlp.experts.<e>.gate_proj.weight`,
or Mixtral's `block_sparse_moe.experts.<e>.w1.weight`); the model holds them stacked per layer, as
transformers 5 does in memory and as the fused kernel reads them. `load_hf_weights` stacks each
layer's experts as they arrive and hands the stacked tensors to the shared loader; a checkpoint
already stacked (`mlp.experts.gate_up_proj`) passes through.
"""

import re

import torch

from kvmesh.worker.layers.moe import SparseMoE
from kvmesh.worker.model_config import ModelConfig
from kvmesh.worker.models.decoder import DecoderForCausalLM

# Mixtral's names -> the names used here (and by transformers 5 in memory)
RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
           (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"))
EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class MoEDecoderForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        for layer_idx in cfg.moe.sparse_layers:
            self.model.layers[layer_idx].mlp = SparseMoE(cfg.moe, cfg.hidden_size)

    def load_hf_weights(self, weights) -> None:
        super().load_hf_weights(self._stack_experts(weights))

    def _stack_experts(self, weights):
        """(name, tensor) pairs with each layer's per-expert tensors replaced by the two stacked ones,
        yielded once the layer's last expert tensor has arrived (a layer's experts at most are held)."""
        num_experts = self.config.moe.num_experts
        pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}  # layer prefix -> pieces
        for name, tensor in weights:
            if ".block_sparse_moe." in name:
                for old, new in RENAMES:
                    name = name.replace(old, new)
            match = EXPERT_WEIGHT.match(name)
            if match is None:
                yield name, tensor
                continue
            prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
            if expert >= num_experts:
                raise ValueError(f"model: weight {name!r} is for expert {expert}, but the config "
                                 f"has {num_experts} experts")
            pieces = pending.setdefault(prefix, {})
            pieces[(expert, proj)] = tensor
            if len(pieces) == 3 * num_experts:
                del pending[prefix]
                yield f"{prefix}.gate_up_proj", torch.stack(
                    [torch.cat([pieces[(e, "gate_proj")], pieces[(e, "up_proj")]]) for e in range(num_experts)])
                yield f"{prefix}.down_proj", torch.stack([pieces[(e, "down_proj")] for e in range(num_experts)])
        for prefix, pieces in pending.items():
            absent = [f"{prefix}.{e}.{p}.weight" for e in range(num_experts)
                      for p in ("gate_proj", "up_proj", "down_proj") if (e, p) not in pieces]
            raise ValueError(f"model: checkpoint is missing {len(absent)} expert weights, e.g. {absent[:3]}")
