"""Hugging Face transformers as the reference model for the engine's tests."""

import torch
from transformers import AutoModelForCausalLM

from kvmesh import LLM


def hf_model_like(llm: LLM):
    """A transformers model with exactly the weights our engine runs (float32, CPU)."""
    engine = llm.engine
    if engine.model_path is not None:  # a real checkpoint: load it independently of our loader
        return AutoModelForCausalLM.from_pretrained(engine.model_path, torch_dtype=torch.float32).eval()
    hf_config = engine.model_config.hf_config
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).cpu() for k, v in engine.model.hf_state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and hf_config.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate for one prompt (stops at the model's EOS like the engine)."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=model.config.eos_token_id
                         if isinstance(model.config.eos_token_id, int) else 0)
    return out[0, len(prompt_ids):].tolist()
