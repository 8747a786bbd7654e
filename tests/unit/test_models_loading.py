"""Loading from a Hugging Face directory and the chat API."""

import torch
from transformers import AutoModelForCausalLM

from kvmesh import LLM, SamplingParams
from kvmesh.worker.presets import build_byte_tokenizer, hf_config_for
from tests.unit.reference import hf_greedy


def save_hf_dir(path, preset: str, seed: int = 3):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config_for(preset), torch_dtype=torch.float32)
    with torch.no_grad():  # transformers initialises some layers to zero: make every weight random
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    build_byte_tokenizer(model.config.vocab_size).save_pretrained(path)
    return model.eval()


def test_hugging_face_directory_with_untied_biased_weights(tmp_path):
    reference = save_hf_dir(tmp_path, "tiny-qwen2")  # q/k/v biases, untied lm_head
    llm = LLM(str(tmp_path))
    assert llm.engine.model_name == tmp_path.name
    ids = llm.encode("loading from a directory")
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=16, temperature=0))[0]
    assert out.token_ids == hf_greedy(reference, ids, 16)


def test_chat_takes_one_conversation_or_many():
    llm = LLM("random:tiny-qwen3")
    params = SamplingParams(max_tokens=6, temperature=0)
    one = [{"role": "user", "content": "hi"}]
    two = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    single = llm.chat(one, params)
    both = llm.chat([one, two], params)
    assert len(single) == 1 and len(both) == 2
    assert both[0].token_ids == single[0].token_ids
    expected_ids = llm.apply_chat_template(two)
    assert both[1].prompt_token_ids == expected_ids
    assert llm.tokenizer.decode(expected_ids).endswith("<|im_start|>assistant\n")
