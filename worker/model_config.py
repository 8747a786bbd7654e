"""ModelConfig: the architecture facts the engine needs, read from a Hugging Face config."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): each token goes through the
    `num_experts_per_tok` experts its router scores highest, weighted by their softmax scores."""
    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k scores to sum to 1 (Mixtral always does)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is sparse; the others are dense


@dataclass(frozen=True)
class ModelConfig:
    name: str
    arch: str  # its key in the model registry (kvmesh.worker.models.MODELS), e.g. "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # set by the MoE architectures (worker/models/moe_decoder.py)
    hf_config: object = field(default=None, compare=False, repr=False)  # for RoPE parameters

    @classmethod
    def from_hf(cls, hf_config, name: str, arch: str) -> "ModelConfig":
        """The fields every decoder reads; an architecture's adapter (its model class's
        `config_from_hf`) sets its own switches on top."""
        check_supported(hf_config, name)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            name=name,
            arch=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=False,
            eos_token_ids=eos_ids,
            hf_config=hf_config,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, per byte of dtype (multiply by element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def check_supported(hf_config, name: str) -> None:
    """A ValueError naming the config field when a checkpoint asks for what the decoder cannot do
    (rather than loading it and computing something else)."""
    from kvmesh.worker.layers.rotary import check_rope

    def unsupported(field_name: str, value, what: str):
        raise ValueError(f"model {name!r}: config.json {field_name}={value!r} is not supported ({what})")

    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        unsupported("hidden_act", act, "the MLP is SiLU-gated only")
    if getattr(hf_config, "mlp_bias", False):
        unsupported("mlp_bias", True, "the MLP projections have no biases")
    if getattr(hf_config, "model_type", None) != "qwen2" and getattr(hf_config, "attention_bias", False):
        # Llama's and Qwen3's attention_bias also puts a bias on o_proj (Qwen2 has q/k/v biases only)
        unsupported("attention_bias", True, "biases on q/k/v/o projections; only Qwen2's q/k/v biases are")
    if getattr(hf_config, "use_sliding_window", False):
        unsupported("use_sliding_window", True, "attention is full, not windowed")
    window = getattr(hf_config, "sliding_window", None)
    if (getattr(hf_config, "model_type", None) == "mixtral" and window is not None
            and window < getattr(hf_config, "max_position_embeddings", 0)):
        unsupported("sliding_window", window, "attention is full, not windowed")
    check_rope(hf_config, name)
