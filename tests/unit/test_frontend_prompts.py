"""The ingress's prompt handling without a cluster: a prompt is measured in characters and refused
before it is tokenized, and a long prompt is tokenized off the event loop, so the loop (which
streams every other client's tokens) keeps running meanwhile."""

import asyncio
import time

import pytest

from kvmesh.cluster.frontend import CHARS_PER_TOKEN_BOUND, INLINE_TOKENIZE_CHARS, Frontend
from kvmesh.cluster.messages import ModelInfo
from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.serve_config import parse_config


def frontend(limits: dict | None = None) -> Frontend:
    fe = Frontend(parse_config({"model": "random:tiny-llama", "limits": limits or {}}), worker_handle=None)
    fe._info = ModelInfo("tiny-llama", max_model_len=512, block_size=16, hash_salt=b"")
    return fe


def test_the_character_limit_defaults_to_a_bound_per_token_of_the_token_limit():
    assert asyncio.run(frontend().max_prompt_chars()) == CHARS_PER_TOKEN_BOUND * 512
    assert asyncio.run(frontend({"max_prompt_tokens": 100}).max_prompt_chars()) == CHARS_PER_TOKEN_BOUND * 100
    assert asyncio.run(frontend({"max_prompt_chars": 7}).max_prompt_chars()) == 7


def test_a_prompt_over_the_character_limit_is_refused_untokenized():
    fe = frontend({"max_prompt_chars": 1000})
    calls = []
    encode = fe.tokenizer.encode
    fe.tokenizer.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    with pytest.raises(ApiError) as e:
        asyncio.run(fe.encode_text("a" * 1001))
    assert (e.value.status, e.value.param) == (400, "prompt")
    assert "1001 characters; the limit is 1000 (limits.max_prompt_chars)" in e.value.message
    with pytest.raises(ApiError) as e:
        asyncio.run(fe.encode_chat([{"role": "user", "content": "a" * 600},
                                    {"role": "user", "content": "b" * 401}]))
    assert e.value.param == "messages" and "1001 characters" in e.value.message
    assert calls == []
    assert asyncio.run(fe.encode_text("a" * 1000)) == [ord("a")] * 1000


def test_tool_call_arguments_in_the_history_count_toward_the_character_limit():
    # an assistant's earlier tool calls go to the chat template beside its content: a history of
    # short contents and long arguments is refused untokenized as a long content would be
    fe = frontend({"max_prompt_chars": 1000})
    calls = []
    fe._tokenize = lambda *a, **k: calls.append(1)
    call = {"type": "function", "id": "call_1", "function": {"name": "f", "arguments": {"x": "y" * 1000}}}
    with pytest.raises(ApiError) as e:
        asyncio.run(fe.encode_chat([{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]},
                                    {"role": "tool", "content": "ok", "tool_call_id": "call_1"}]))
    assert e.value.param == "messages" and "the limit is 1000" in e.value.message
    assert calls == []


def test_a_message_counts_its_content_and_the_json_of_what_else_it_carries():
    from kvmesh.cluster.frontend import message_chars

    assert message_chars({"role": "user", "content": "abc"}) == 3
    assert message_chars({"role": "assistant", "content": None}) == 0
    assert message_chars({"role": "tool", "content": "ok", "tool_call_id": "call_1"}) == 2 + 6
    calls = [{"function": {"name": "f", "arguments": {"x": "é"}}}]
    assert message_chars({"role": "assistant", "content": "", "tool_calls": calls}) == len(
        '[{"function": {"name": "f", "arguments": {"x": "é"}}}]')


def test_a_long_prompt_is_tokenized_while_the_event_loop_keeps_running():
    fe = frontend({"max_prompt_chars": 50_000_000, "max_prompt_tokens": 50_000_000})
    text = "the quick brown fox " * 250_000  # 5 MB: about a second of tokenizing here

    async def run():
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        start = time.monotonic()
        ids = await fe.encode_text(text)
        took = time.monotonic() - start
        stop.set()
        await tick
        return ids, took, gaps

    ids, took, gaps = asyncio.run(run())
    assert len(ids) == len(text.encode())
    # The loop ran all along: many ticks while tokenizing, none blocked for the whole of it.
    assert len(gaps) >= 10 and max(gaps) < took / 2, (took, max(gaps), len(gaps))


def test_short_prompts_stay_on_the_loop():
    fe = frontend()
    fe._tokenize_pool.shutdown()  # a short prompt must not need the pool
    assert asyncio.run(fe.encode_text("x" * INLINE_TOKENIZE_CHARS)) == [ord("x")] * INLINE_TOKENIZE_CHARS


def test_a_prompt_the_model_cannot_hold_is_refused_naming_the_field_and_the_limit():
    fe = frontend()  # max_model_len 512
    with pytest.raises(ApiError) as e:
        asyncio.run(fe.check_prompt([1] * 512, "messages"))
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "context_length_exceeded")
    assert e.value.message == ("the prompt is 512 tokens; the limit is 511 "
                               "(max_model_len 512 minus 1 generated token)")
    with pytest.raises(ApiError) as e:
        asyncio.run(fe.check_prompt([], "prompt"))
    assert (e.value.status, e.value.param) == (400, "prompt") and "at least 1 token" in e.value.message
    assert asyncio.run(fe.check_prompt([1] * 511, "prompt")).max_model_len == 512


def test_a_routed_request_carries_the_prompt_hashes_and_their_block_size_to_the_engine():
    from kvmesh.hashing import block_hashes

    fe = frontend()
    info = asyncio.run(fe.model_info())
    routed = fe.routed_request(list(range(40)), None, info, session_key=None)
    assert routed.hash_block_size == 16
    assert routed.block_hashes == block_hashes(list(range(40)), 16, b"") and len(routed.block_hashes) == 2


def test_a_chat_template_that_fails_on_a_request_is_a_400_naming_what_it_was_given():
    """SERVING.md: "a template that fails on them is a 400" (here a template that raises, as
    templates do on what they cannot render), naming chat_template_kwargs when some were given."""
    from kvmesh.worker.chat_template import TemplateOptions

    fe = frontend()
    fe.tokenizer.chat_template = ("{% if strict is defined and strict %}{{ raise_exception('not in strict mode') }}"
                                  "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    assert asyncio.run(fe.encode_chat(messages)) == [ord("h"), ord("i")]
    with pytest.raises(ApiError) as e:
        asyncio.run(fe.encode_chat(messages, options=TemplateOptions(kwargs={"strict": True})))
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")
    assert "not in strict mode" in e.value.message
