"""ModelConfig: the architecture facts the engine needs, read from a Hugging Face config."""

from dataclasses import dataclass, field

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
    hf_config: object = field(default=None, compare=False, repr=False)  # for RoPE parameters

    @classmethod
    def from_hf(cls, hf_config, name: str, arch: str) -> "ModelConfig":
        """The fields every decoder reads; an architecture's adapter (its model class's
        `config_from_hf`) sets its own switches on top."""
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
