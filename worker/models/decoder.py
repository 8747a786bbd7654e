"""The decoder of the Llama family (this class as is), and through two switches of ModelConfig, of
Qwen2 (q/k/v biases, qwen2.py) and Qwen3 (per-head RMSNorm on q and k before RoPE, qwen3.py). Parameter
names follow Hugging Face's except the fused projections (qkv_proj, gate_up_proj), which the
loader packs from q/k/v_proj and gate/up_proj.

The linear layers, embedding and LM head are the tensor-parallel ones (layers/parallel.py): built
inside `tensor_parallel.building_with(tp)` each rank holds its heads and its slice of the MLP and
vocabulary; built outside it they are the plain layers.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.worker.attention.base import get_forward_context
from kvmesh.worker.layers.kernels import FUSE_KV_STORE, FUSE_NORMS, use_kernels
from kvmesh.worker.layers.norm import RMSNorm
from kvmesh.worker.layers.parallel import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                           RowParallelLinear, VocabParallelEmbedding)
from kvmesh.worker.layers.rotary import RotaryEmbedding
from kvmesh.worker.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding):
        """q [T, H, D], k and v [T, Hkv, D]: projected, normed (Qwen3) and rotated. With the GPU
        kernels the rotation's launch also writes k and v into this layer's KV cache, and they come
        back None: the attention backend then only reads the cache."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not use_kernels(q):  # the torch layers (CPU, or traced by torch.compile)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(positions, q, k)
            return q, k, v
        norm = None  # Qwen3's q / k norms inside the rotation's launch (kvmesh.kernels.rotary)
        if self.q_norm is not None:
            if FUSE_NORMS and self.q_norm.weight.dtype == self.k_norm.weight.dtype == q.dtype:
                norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        if FUSE_KV_STORE:
            from kvmesh.kernels.rotary import rotate_and_store

            ctx, (k_cache, v_cache), (k_scale, v_scale) = self._layer_cache()
            q = rotate_and_store(positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache,
                                 ctx.metadata.slot_mapping, k_scale, v_scale, norm=norm)
            return q, None, None
        if norm is not None:
            from kvmesh.kernels.rotary import apply_qk_norm_rotary

            q, k = apply_qk_norm_rotary(positions, q, k, *norm, rotary.cos, rotary.sin)
        else:
            q, k = rotary(positions, q, k)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention backend over the paged KV cache (writes k and v into it unless the rotation
        did: None): [T, H * D]."""
        ctx, (k_cache, v_cache), (k_scale, v_scale) = self._layer_cache()
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.metadata, k_scale, v_scale)  # [T, H, D]
        return out.reshape(q.shape[0], self.q_size)

    def _layer_cache(self):
        """(the step's forward context, this layer's (k_cache, v_cache), its FP8 KV scales (1.0
        otherwise))."""
        ctx = get_forward_context()
        return ctx, ctx.kv_caches[self.layer_idx], ctx.kv_scale(self.layer_idx)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.intermediate_size = self.gate_up_proj.local_sizes[0]  # this rank's
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):  # one fused launch (kvmesh.kernels.silu_and_mul)
            from kvmesh.kernels.silu_and_mul import silu_and_mul
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # The residual stream is carried as (hidden, residual): each layer returns its MLP output
    # unadded, and the next norm adds it. The layer's work outside attention is two regions,
    # before and after it, that torch.compile can take whole (worker/compile.py).
    def before_attention(self, positions, hidden, residual, rotary):
        if residual is None:  # the first layer: the embeddings are the stream
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        q, k, v = self.self_attn.project(positions, hidden, rotary)
        return q, k, v, residual

    def after_attention(self, attn_out, residual):
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual)
        return self.mlp(hidden), residual

    def forward(self, positions, hidden, residual, rotary):
        q, k, v, residual = self.before_attention(positions, hidden, residual, rotary)
        return self.after_attention(self.self_attn.attend(q, k, v), residual)


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.rotary)
        return self.norm(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    # Hugging Face checkpoint names -> (our fused parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def config_from_hf(cls, hf_config, name: str, arch: str) -> ModelConfig:
        """This architecture's config adapter: the engine's ModelConfig from a Hugging Face config
        (subclasses set their switches)."""
        return ModelConfig.from_hf(hf_config, name, arch)

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg, max_positions)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def shard_sizes(self, fused: str, layer_idx: int) -> list[int]:
        cfg = self.config
        if fused == "qkv_proj":
            return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        return [cfg.intermediate_size, cfg.intermediate_size]

    @torch.no_grad()
    def load_hf_weights(self, weights) -> None:
        """Copy (name, tensor) pairs in Hugging Face naming into this model, packing fused projections."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for hf_part, (fused, index) in self.packed_modules.items():
                if f".{hf_part}." in name:
                    target, shard = name.replace(f".{hf_part}.", f".{fused}."), index
                    break
            if target not in params:
                raise ValueError(f"model: unexpected weight {name!r} in the checkpoint")
            param = params[target]
            weight_loader = getattr(param, "weight_loader", None)
            if weight_loader is not None:  # a parallel layer's: copies this rank's slice
                weight_loader(param, tensor, shard, name)
            elif shard is None:
                _copy(param, tensor, name)
            else:
                layer_idx = int(name.split(".layers.")[1].split(".")[0])
                sizes = self.shard_sizes(target.split(".")[-2], layer_idx)
                start = sum(sizes[:shard])
                _copy(param.narrow(0, start, sizes[shard]), tensor, name)
            loaded.add((target, shard))
        expected = set()
        for pname in params:
            fused = pname.split(".")[-2]
            if fused in ("qkv_proj", "gate_up_proj"):
                n = 3 if fused == "qkv_proj" else 2
                expected.update((pname, i) for i in range(n))
            else:
                expected.add((pname, None))
        missing = sorted(str(m[0]) for m in expected - loaded)
        if missing:
            raise ValueError(f"model: checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Our weights in Hugging Face naming (unpacked): for reference models in tests and for saving."""
        if self.model.embed_tokens.tp.size > 1:
            raise ValueError("hf_state_dict: this model is one rank's shard (tensor_parallel_size > 1)")
        out = {}
        for name, param in self.named_parameters():
            fused = name.split(".")[-2]
            if fused in ("qkv_proj", "gate_up_proj"):
                parts = [k for k, (f, _) in self.packed_modules.items() if f == fused]
                layer_idx = int(name.split(".layers.")[1].split(".")[0])
                chunks = param.split(self.shard_sizes(fused, layer_idx), dim=0)
                for part, chunk in zip(parts, chunks):
                    out[name.replace(f".{fused}.", f".{part}.")] = chunk
            else:
                out[name] = param
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.copy_(tensor.to(param.dtype))
