"""How kvmesh.LLM and the chat template turn prompts into tokens (docs/SERVING.md "API fields"):
vLLM's add_special_tokens (a text prompt gets the tokenizer's special tokens, a BOS here as Llama
3's tokenizer adds, unless asked not to; a chat gets them around its rendered template only when
asked) and a caller's own chat_template in LLM.chat."""

import pytest

from bos_checkpoint import BOS, save_bos_checkpoint
from kvmesh import LLM, SamplingParams
from kvmesh.worker.chat_template import TemplateOptions, encode_chat, with_special_tokens

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(str(save_bos_checkpoint(tmp_path_factory.mktemp("bos"))), device="cpu") as llm:
        yield llm


def test_llm_encode_and_generate_add_the_bos_as_vllm_does(llm):
    assert llm.encode("hi") == [BOS, *b"hi"]
    assert llm.encode("hi", add_special_tokens=False) == list(b"hi")
    params = SamplingParams(max_tokens=4, temperature=0)
    (out,) = llm.generate("hi", params, use_tqdm=False)
    assert out.prompt_token_ids == [BOS, *b"hi"]
    (same,) = llm.generate(prompt_token_ids=[[BOS, *b"hi"]], sampling_params=params, use_tqdm=False)
    assert out.token_ids == same.token_ids


def test_a_chat_gets_the_special_tokens_only_when_asked(llm):
    plain = llm.apply_chat_template(MESSAGES)
    assert plain[0] != BOS and plain == encode_chat(llm.tokenizer, MESSAGES)
    asked = encode_chat(llm.tokenizer, MESSAGES, options=TemplateOptions(add_special_tokens=True))
    assert asked == [BOS, *plain]
    trusted = encode_chat(llm.tokenizer, MESSAGES, special_tokens_in_content=True,
                          options=TemplateOptions(add_special_tokens=True))
    assert trusted == asked


def test_with_special_tokens_adds_nothing_for_a_tokenizer_that_adds_none():
    from kvmesh.worker.presets import build_byte_tokenizer

    assert with_special_tokens(build_byte_tokenizer(300), [1, 2, 3]) == [1, 2, 3]


def test_llm_chat_takes_a_chat_template_of_its_own(llm):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert llm.apply_chat_template(MESSAGES, chat_template=template) == list(b"<user>hi")
    (out,) = llm.chat(MESSAGES, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False,
                      chat_template=template)
    assert out.prompt_token_ids == list(b"<user>hi")
