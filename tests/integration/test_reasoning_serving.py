"""A reasoning model's answers on a live cluster with server.reasoning_parser qwen3 (vLLM's
--reasoning-parser; docs/SERVING.md "Reasoning models"): the thinking block goes to the message's
`reasoning`, the rest to `content`, whole and streamed (the official openai client reads both),
tools read from the content only, include_reasoning false drops the reasoning, a prompt whose
thinking block is closed (Qwen3's enable_thinking false) leaves the answer all content; gRPC's
`reasoning` field and /v1/responses' reasoning item say the same.

The random model does not think by itself: a regex holds it to a thinking block's form, which
`server.structured_outputs_in_reasoning` (vLLM's enable_in_reasoning) lets the grammar constrain.
Where the grammar starts by default, after </think>: test_reasoning_grammar.py.
"""

import json
import re

import pytest

from cluster_support import config_cluster
from kvmesh.cluster.client import grpc_stream
from reliability_support import http
from test_cluster_serving import responses_events

pytestmark = pytest.mark.slow

MODEL = "random:tiny-qwen3"  # its byte tokenizer has <think> and </think> as tokens
ASK = [{"role": "user", "content": "Is 9.11 greater than 9.8?"}]
THINKING = "<think>\\n[a-c]{6}\\n</think>\\n\\n[x-z]{5}"  # a thinking block, then the answer
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
THINK_THEN_CALL = ('<think>\\n[a-c]{4}\\n</think>\\n\\n<tool_call>\\n\\{"name": "get_weather", '
                   '"arguments": \\{"city": "(Paris|Rome|Oslo)"\\}\\}\\n</tool_call>')


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = {"model": MODEL, "engine": {"device": "cpu"},
              "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1},
              "server": {"reasoning_parser": "qwen3", "structured_outputs_in_reasoning": True}}
    with config_cluster(tmp_path_factory, config) as c:
        yield c


def chat(cluster, regex: str, **extra) -> dict:
    status, answer, _ = http(cluster.http_url + "/v1/chat/completions",
                             {"model": MODEL, "messages": ASK, "max_tokens": 120, "temperature": 0,
                              "structured_outputs": {"regex": regex}, **extra})
    assert status == 200, answer
    return answer


def test_the_thinking_block_is_the_reasoning_and_the_rest_the_content(openai_client):
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0,
        extra_body={"structured_outputs": {"regex": THINKING}})
    message = answer.choices[0].message
    assert re.fullmatch("\n[a-c]{6}\n", message.reasoning), message  # the markers in neither field
    assert re.fullmatch("\n\n[x-z]{5}", message.content), message
    assert answer.choices[0].finish_reason == "stop"


def test_streamed_the_reasoning_comes_first_and_joins_to_the_whole_answer(openai_client, cluster):
    whole = chat(cluster, THINKING)["choices"][0]["message"]
    kinds, reasoning, content = [], "", ""
    for chunk in openai_client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=120, temperature=0, stream=True,
            extra_body={"structured_outputs": {"regex": THINKING}}):
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning", None)
        if piece:
            kinds.append("reasoning")
            reasoning += piece
        if delta.content:
            kinds.append("content")
            content += delta.content
    assert (reasoning, content) == (whole["reasoning"], whole["content"])
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # all reasoning, then content
    assert kinds.count("reasoning") > 1  # it streamed as it was generated, not at the block's end


def test_include_reasoning_false_drops_the_reasoning_and_keeps_the_content(cluster, openai_client):
    whole = chat(cluster, THINKING)["choices"][0]["message"]
    without = chat(cluster, THINKING, include_reasoning=False)["choices"][0]["message"]
    assert without["reasoning"] is None and without["content"] == whole["content"]
    content = ""
    for chunk in openai_client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=120, temperature=0, stream=True,
            extra_body={"structured_outputs": {"regex": THINKING}, "include_reasoning": False}):
        assert getattr(chunk.choices[0].delta, "reasoning", None) is None
        content += chunk.choices[0].delta.content or ""
    assert content == whole["content"]


def test_an_answer_without_a_thinking_block_is_all_content(cluster):
    message = chat(cluster, "[x-z]{5}")["choices"][0]["message"]
    assert message["reasoning"] is None and re.fullmatch("[x-z]{5}", message["content"])


def test_with_thinking_switched_off_in_the_prompt_a_block_in_the_answer_is_content(cluster):
    """Qwen3's enable_thinking false closes an empty block in the prompt: the answer is content,
    whatever it holds."""
    message = chat(cluster, "<think>[a-c]{2}</think>[x-z]{2}",
                   chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert message["reasoning"] is None
    assert re.fullmatch("<think>[a-c]{2}</think>[x-z]{2}", message["content"])


def test_tool_calls_are_read_from_the_content_after_the_thinking_block(openai_client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=120, temperature=0, tools=[WEATHER],
                  extra_body={"structured_outputs": {"regex": THINK_THEN_CALL}})
    choice = openai_client.chat.completions.create(**kwargs).choices[0]
    assert re.fullmatch("\n[a-c]{4}\n", choice.message.reasoning)
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
    reasoning, fragments, reasons = "", [], []
    for chunk in openai_client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning", None) or ""
        # neither the block nor the call markup (the blank line before the call streams as
        # content, as the tool parser streams text before a <tool_call>)
        assert not (delta.content or "").strip()
        fragments += [tc.function.arguments or "" for tc in delta.tool_calls or []]
        reasons.append(chunk.choices[0].finish_reason)
    assert reasoning == choice.message.reasoning
    assert json.loads("".join(fragments)) == json.loads(call.function.arguments)
    assert reasons[-1] == "tool_calls"


def test_grpc_streams_the_reasoning_in_its_own_field(cluster):
    whole = chat(cluster, THINKING)["choices"][0]["message"]
    from kvmesh.proto import kvmesh_pb2 as pb

    spec = pb.StructuredOutputs(regex=THINKING)
    messages = list(grpc_stream(cluster.grpc_target, messages=ASK, max_tokens=120, temperature=0,
                                structured_outputs=spec))
    assert "".join(m.reasoning for m in messages) == whole["reasoning"]
    assert "".join(m.text for m in messages) == whole["content"]
    assert sum(bool(m.reasoning) for m in messages) > 1
    off = list(grpc_stream(cluster.grpc_target, messages=ASK, max_tokens=120, temperature=0,
                           structured_outputs=spec, include_reasoning=False))
    assert not any(m.reasoning for m in off) and "".join(m.text for m in off) == whole["content"]


def test_a_response_has_the_reasoning_item_before_the_message_whole_and_streamed(openai_client, cluster):
    """/v1/responses (vLLM's structured_outputs and include_reasoning fields pass through): the
    thinking block is a reasoning item, the official client's `output_text` the content; streamed,
    response.reasoning_text.delta events join to the same text; a reasoning item sent back as
    input is taken and not rendered (the same answer as without it); chat_template_kwargs and
    reasoning.effort "none" switch thinking off."""
    whole = chat(cluster, THINKING)["choices"][0]["message"]
    kwargs = dict(model=MODEL, input=ASK[0]["content"], max_output_tokens=120, temperature=0,
                  extra_body={"structured_outputs": {"regex": THINKING}})
    response = openai_client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert [c.text for c in response.output[0].content] == [whole["reasoning"]]
    assert response.output_text == whole["content"]
    events = responses_events(cluster, {"model": MODEL, "input": ASK[0]["content"], "max_output_tokens": 120,
                                        "temperature": 0, "structured_outputs": {"regex": THINKING}})
    deltas = [data["delta"] for kind, data in events if kind == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole["reasoning"]
    done = dict(events)["response.completed"]["response"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"][0]["text"] == whole["reasoning"]
    assert done["output"][1]["content"][0]["text"] == whole["content"]
    without = openai_client.responses.create(**{**kwargs, "extra_body": {
        **kwargs["extra_body"], "include_reasoning": False}})
    assert [item.type for item in without.output] == ["message"] and without.output_text == whole["content"]
    replayed = openai_client.responses.create(**{**kwargs, "input": [
        {"role": "user", "content": "Earlier question."}, response.output[0].model_dump(exclude_none=True),
        {"role": "assistant", "content": "Earlier answer."}, {"role": "user", "content": ASK[0]["content"]}]})
    plain = openai_client.responses.create(**{**kwargs, "input": [
        {"role": "user", "content": "Earlier question."}, {"role": "assistant", "content": "Earlier answer."},
        {"role": "user", "content": ASK[0]["content"]}]})
    assert replayed.output_text == plain.output_text
    # thinking switched off in the prompt, by chat_template_kwargs or by reasoning.effort "none": the
    # block the regex still makes is content
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning": {"effort": "none"}}):
        off = openai_client.responses.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], **extra}})
        assert [item.type for item in off.output] == ["message"], extra
        assert off.output_text.startswith("<think>"), extra
