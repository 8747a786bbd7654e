"""What a kvmesh.v1 GenerateRequest asks beyond sampling (cluster/grpc_fields.py), without a
cluster: tools and tool_choice read as HTTP reads them (errors name the gRPC field), the
constraint built once and handed to the sampling params, echo and prompt logprobs on the first
messages, tool calls parsed out of the text into tool-call deltas."""

import json

import pytest

from kvmesh.cluster.grpc_fields import ResponseShape, read_ask
from kvmesh.cluster.grpc_service import generation_request
from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.protocol import PromptLogprobs, TokenDelta

WEATHER = pb.Tool(name="get_weather", description="Weather of a city",
                  parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
ASK = [pb.ChatMessage(role="user", content="Weather in Rome?")]


def test_a_named_tool_choice_forces_its_arguments_schema_built_once():
    request = pb.GenerateRequest(messages=ASK, tools=[WEATHER], tool_choice="get_weather")
    ask = read_ask(request)
    assert ask.tools.choice == "function" and ask.structured.param == "tool_choice"
    assert json.loads(ask.structured.spec.json) == json.loads(WEATHER.parameters)
    request = pb.GenerateRequest(prompt="hi", structured_outputs=pb.StructuredOutputs(regex="a+"))
    ask = read_ask(request)
    params = generation_request(request, 0.0, "req-1", ask).sampling(16)
    assert params.structured_outputs is ask.structured.spec  # the one compiled, not a rebuild


@pytest.mark.parametrize("fields, param", [
    ({"messages": ASK, "tools": [pb.Tool(name="f", parameters="{not json")]}, "tools.0.parameters"),
    ({"messages": ASK, "tools": [pb.Tool(name="")]}, "tools.0.function"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": "nope"}, "tool_choice"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ({"prompt": "hi", "tools": [WEATHER]}, "tools"),
    ({"messages": ASK, "tools": [WEATHER], "logprobs": 1}, "logprobs"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
      "structured_outputs": pb.StructuredOutputs(regex="a")}, "structured_outputs"),
])
def test_bad_tool_requests_name_the_grpc_field(fields, param):
    with pytest.raises(ApiError) as e:
        read_ask(pb.GenerateRequest(**fields))
    assert e.value.status == 400 and e.value.param == param


def test_tool_choice_none_parses_nothing_and_needs_no_messages():
    ask = read_ask(pb.GenerateRequest(prompt="hi", tools=[WEATHER], tool_choice="none"))
    assert ask.tools.choice == "none" and ask.structured is None


def test_echo_and_prompt_logprobs_come_on_the_first_messages():
    request = pb.GenerateRequest(prompt="a b c", echo=True, logprobs=2)
    params = generation_request(request, 0.0, "req-1", read_ask(request)).sampling(16)
    assert params.prompt_logprobs == 2  # echo with logprobs scores the prompt
    shape = ResponseShape(request, read_ask(request), [7, 8, 9], decode=lambda ids: "unused")
    scores = PromptLogprobs([None, -1.0, -2.0], [None, 1, 3], [None, {8: -1.0, 4: -3.0, 5: -4.0},
                                                                {5: -0.5}])
    first = shape.apply(pb.GenerateResponse(text=""), TokenDelta("r", [], ""))
    second = shape.apply(pb.GenerateResponse(text="x"),
                         TokenDelta("r", [1], "x", prompt_logprobs=scores))
    assert first.prompt_text == "a b c" and list(first.prompt_token_ids) == [7, 8, 9]
    assert second.prompt_text == "" and not second.prompt_token_ids
    entries = second.prompt_logprobs
    assert not entries[0].HasField("logprob") and entries[1].logprob == -1.0
    assert entries[2].rank == 3 and dict(entries[1].top) == {8: -1.0, 4: -3.0}  # top 2


def test_auto_tool_calls_stream_as_tool_call_deltas_and_the_markup_is_no_text():
    request = pb.GenerateRequest(messages=ASK, tools=[WEATHER])
    shape = ResponseShape(request, read_ask(request), [1], decode=str)
    pieces = ['Sure.\n<tool_call>\n{"name": "get_', 'weather", "arguments": {"city": ',
              '"Rome"}}\n</tool_call>']
    out = [shape.apply(pb.GenerateResponse(text=p), TokenDelta("r", [1], p)) for p in pieces[:-1]]
    out.append(shape.apply(pb.GenerateResponse(text=pieces[-1]),
                           TokenDelta("r", [1], pieces[-1], finish_reason="stop")))
    assert "".join(m.text for m in out) == "Sure.\n"
    calls = [c for m in out for c in m.tool_calls]
    assert calls[0].name == "get_weather" and calls[0].id.startswith("chatcmpl-tool-")
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Rome"}
    assert out[-1].finish_reason == "tool_calls"


def test_history_calls_and_tool_results_are_rendered_as_http_renders_them():
    from types import SimpleNamespace

    from kvmesh.cluster.grpc_fields import chat_messages

    request = pb.GenerateRequest(messages=[
        pb.ChatMessage(role="user", content="Weather in Rome?"),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
            id="call_1", name="get_weather", arguments='{"city": "Rome"}')]),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content="sunny")], tools=[WEATHER])
    template = SimpleNamespace(chat_template="{{ messages }}")  # a template without tools
    messages, template_tools = chat_messages(request, read_ask(request).tools, template)
    assert template_tools is None and messages[0]["role"] == "system"  # the tools block
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                           '"arguments": {"city": "Rome"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_with_n2_each_sequence_is_parsed_on_its_own():
    request = pb.GenerateRequest(messages=ASK, tools=[WEATHER], n=2)
    shape = ResponseShape(request, read_ask(request), [1], decode=str)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    out = [shape.apply(pb.GenerateResponse(text=call[:20], index=0), TokenDelta("r", [1], call[:20])),
           shape.apply(pb.GenerateResponse(text="No call.", index=1),
                       TokenDelta("r", [1], "No call.", finish_reason="stop", index=1,
                                  more_sequences=True)),
           shape.apply(pb.GenerateResponse(text=call[20:], index=0),
                       TokenDelta("r", [1], call[20:], finish_reason="stop"))]
    assert (out[1].text, list(out[1].tool_calls), out[1].finish_reason) == ("No call.", [], "stop")
    assert json.loads("".join(c.arguments for m in (out[0], out[2]) for c in m.tool_calls)) == {
        "city": "Rome"}
    assert out[2].finish_reason == "tool_calls" and all(c.index == 0 for c in out[2].tool_calls)
