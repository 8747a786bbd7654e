"""A tiny random Llama checkpoint whose tokenizer adds a BOS token to a text when asked for its
special tokens, as Llama 3's does (the byte tokenizer of the random presets adds none)."""

BOS = 256  # the byte tokenizer's <|endoftext|>
VOCAB = 512


def save_bos_checkpoint(path):
    import torch
    from tokenizers import processors
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvmesh.worker.presets import build_byte_tokenizer

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=BOS, eos_token_id=258, pad_token_id=BOS)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if name.endswith("norm.weight") else param.normal_(0, 0.05)
    model.save_pretrained(path)
    tokenizer = build_byte_tokenizer(VOCAB)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", BOS)])
    tokenizer.save_pretrained(path)
    return path
