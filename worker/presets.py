"""Random-weight model presets (`random:<name>`): real architectures with random weights, for tests
and benchmarks. The tokenizer is a byte-level one built locally (no download)."""

# What Qwen3's dense checkpoints share; a preset of that family adds its sizes.
QWEN3_DENSE = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, head_dim=128,
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960)

PRESETS = {
    # The benchmark shape of DESIGN.md "Performance".
    "qwen3-0.6b": dict(
        QWEN3_DENSE, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    # Qwen3-8B's shape (untied), for tensor parallelism on 2 GPUs (issue 17).
    "qwen3-8b": dict(
        QWEN3_DENSE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "tiny-qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048,
        tie_word_embeddings=True),
    "tiny-qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048,
        tie_word_embeddings=False),
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=False),
    # Llama 3.2's RoPE scaling on a tiny shape (exercises the llama3 rope type).
    "tiny-llama3": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
        tie_word_embeddings=True),
    # Qwen3-MoE: q/k norm, 8 experts of which each token takes 2, renormalised; layer 1 dense
    # (mlp_only_layers), as the family's configs allow.
    "tiny-qwen3-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=2048, tie_word_embeddings=False),
    "tiny-mixtral": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=512, hidden_size=64,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=2048, tie_word_embeddings=False),
    # A benchmark MoE shape that fits one GPU: Qwen3-30B-A3B's width (128 experts, 8 per token, expert
    # width 768, hidden 2048, 32 q / 4 kv heads) with 8 of its 48 layers: 5.6B parameters (0.45B
    # of them per token in the layers), 11 GiB in bf16.
    "qwen3-moe-a3b-small": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False),
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's thinking-block markers: added tokens that are not special (decoded text keeps them, as
# Qwen3's tokenizer does), so the presets serve with `--reasoning-parser qwen3 / deepseek_r1`.
THINK_TOKENS = ["<think>", "</think>"]

# ChatML, with Qwen3's switch for its thinking block: `enable_thinking: false` (a chat_template_kwargs
# variable) opens the assistant's turn with an empty one, as Qwen3's own template does.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def hf_config_for(preset: str):
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"model: unknown preset 'random:{preset}'; known: "
                         + ", ".join(f"random:{p}" for p in PRESETS))
    kwargs = dict(PRESETS[preset])
    model_type = kwargs.pop("model_type")
    rope_scaling = kwargs.pop("rope_scaling", None)
    # Special tokens sit right after the 256 byte tokens; EOS is <|im_end|>.
    kwargs.update(bos_token_id=256, eos_token_id=258, pad_token_id=256)
    config = AutoConfig.for_model(model_type, **kwargs)
    if rope_scaling is not None:
        params = dict(rope_scaling, rope_theta=kwargs["rope_theta"])
        if hasattr(config, "rope_parameters"):
            config.rope_parameters = params
        else:  # transformers 4.x
            config.rope_scaling = params
    return config


def build_byte_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with no merges: ids 0-255 are bytes, then the special tokens and
    the thinking-block markers, then filler tokens up to vocab_size (so every id a random model samples decodes)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    for i, tok in enumerate(SPECIAL_TOKENS + THINK_TOKENS):
        vocab[tok] = 256 + i
    for i in range(256 + len(SPECIAL_TOKENS) + len(THINK_TOKENS), vocab_size):
        vocab[f"<|t{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map (what ByteLevel uses).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
