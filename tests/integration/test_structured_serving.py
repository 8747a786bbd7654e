"""Structured outputs and tool calls end to end: `kvmesh serve` of the default model (SmolLM2) on
the CPU, reached with the official openai client over HTTP on 127.0.0.1.

One cluster for the module (starting one is the expensive part): add cases here.
"""

import json
import re

import jsonschema
import pytest

from kvmesh.cluster.local import LocalCluster
from test_cluster_serving import post, responses_events

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer"},
                       "capital": {"type": "boolean"}},
        "required": ["city", "population", "capital"], "additionalProperties": False}
ASK_CITY = [{"role": "user", "content": "Give the city, population and whether it is a capital, "
                                        "for Paris, as JSON."}]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(["--replicas", "1", "--device", "cpu", "--model", MODEL]) as c:
        yield c


# ---- structured outputs ------------------------------------------------------------------------

def test_response_format_json_schema_is_parsed_and_schema_valid(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, max_tokens=80, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


def test_streamed_json_schema_output_is_schema_valid(openai_client):
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, max_tokens=80, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), CITY)


def test_n3_with_a_json_schema_gives_three_schema_valid_choices(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, max_tokens=80, temperature=1.0, seed=5, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), CITY)


def test_response_format_json_object_gives_an_object(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Answer in JSON: what is the capital of France?"}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_structured_outputs_choice_gives_one_of_the_choices(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": "Is Paris the capital of Italy?"}],
        extra_body={"structured_outputs": {"choice": ["YES", "NO"]}})
    assert r.choices[0].message.content in ("YES", "NO")


def test_older_guided_regex_on_completions(openai_client):
    r = openai_client.completions.create(model=MODEL, prompt="My phone number is ", max_tokens=20,
                                  temperature=0.7, seed=1,
                                  extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text)


STRUCTURED_ERRORS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_json": {"type": 7}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
]


@pytest.mark.parametrize("fields,param", STRUCTURED_ERRORS, ids=[p for _, p in STRUCTURED_ERRORS])
def test_a_bad_constraint_is_a_400_naming_the_field(cluster, fields, param):
    code, err, _ = post(cluster, "/v1/chat/completions",
                        {"model": MODEL, "messages": ASK_CITY, "max_tokens": 4, **fields})
    assert code == 400, err
    assert err["error"]["param"] == param


# ---- tool calls --------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_choice_is_parsed_into_tool_calls(openai_client):
    r = openai_client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=40,
                                       temperature=0, tools=[WEATHER, TIME],
                                       tool_choice=FORCE_WEATHER)
    message = r.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert r.choices[0].finish_reason == "stop"  # a forced function ends as OpenAI's does


def test_a_named_tool_choice_streams_tool_call_deltas(openai_client):
    stream = openai_client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=40,
                                            temperature=0, tools=[WEATHER, TIME],
                                            tool_choice=FORCE_WEATHER, stream=True,
                                            stream_options={"include_usage": True})
    name, arguments, ids, content, reasons, usage = None, "", set(), "", [], None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            ids.add(tc.id) if tc.id else None
            name = (tc.function.name if tc.function and tc.function.name else name)
            arguments += (tc.function.arguments or "") if tc.function else ""
    assert name == "get_weather" and len(ids) == 1 and content == ""
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert reasons[-1] == "stop"
    assert usage is not None and usage.completion_tokens > 0


def test_tool_choice_auto_with_a_plain_answer_is_content_whole_and_streamed(openai_client):
    """The default model answers this in prose: no call parsed, the text is the content."""
    ask = [{"role": "user", "content": "Say hello to me."}]
    r = openai_client.chat.completions.create(model=MODEL, messages=ask, max_tokens=20, temperature=0,
                                       tools=[WEATHER], logprobs=True)
    message = r.choices[0].message
    assert message.content and not message.tool_calls
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens  # kept when not streamed
    assert r.choices[0].finish_reason in ("stop", "length")
    stream = openai_client.chat.completions.create(model=MODEL, messages=ask, max_tokens=20,
                                            temperature=0, tools=[WEATHER], stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_tool_choice_required_gives_at_least_one_call_of_a_given_tool(openai_client):
    r = openai_client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=80,
                                       temperature=0, tools=[WEATHER, TIME],
                                       tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_streams_the_same_call(openai_client):
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, max_tokens=80, temperature=0,
                  tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    whole = openai_client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    name, arguments, reasons = None, "", []
    for chunk in openai_client.chat.completions.create(**kwargs, stream=True):
        reasons.append(chunk.choices[0].finish_reason)
        for tc in chunk.choices[0].delta.tool_calls or []:
            name = tc.function.name or name
            arguments += tc.function.arguments or ""
    assert name == whole.function.name
    assert json.loads(arguments) == json.loads(whole.function.arguments)
    assert reasons[-1] == "tool_calls"


# The default model does not call tools by itself: a regex holds it to each form, which the
# `auto` parser then reads from the output as it would read a model's own call.
AUTO_FORMS = [  # arguments of some 30 tokens: they stream in several deltas
    ('Checking\\.\\n<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": '
     '"(Paris|Rome|Oslo)", "days": [1-9], "units": "(metric|imperial)", "detail": '
     '"(hourly|daily)", "language": "(English|French)"\\}\\}\\n</tool_call>', "Checking.\n",
     "get_weather"),
    ('\\{"name": "get_time", "parameters": \\{"timezone": "(Europe/Paris|UTC)", "format": '
     '"(24h|12h)", "seconds": (true|false), "language": "(English|French)"\\}\\}', "",
     "get_time"),
]


@pytest.mark.parametrize("regex, content, name", AUTO_FORMS, ids=["hermes", "llama3"])
def test_tool_choice_auto_streams_call_deltas_as_generated(openai_client, regex, content, name):
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, max_tokens=150, temperature=0,
                  tools=[WEATHER, TIME], extra_body={"structured_outputs": {"regex": regex}})
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    streamed_content, headers, fragments, reasons = "", [], [], []
    for chunk in openai_client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        streamed_content += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            if tc.id:  # the call's first delta: id, type, name, arguments ""
                headers.append((tc.type, tc.function.name, tc.function.arguments))
            else:
                fragments.append(tc.function.arguments)
    assert streamed_content == content  # the text before the call; never the markup
    assert headers == [("function", name, "")]
    assert len(fragments) > 1  # the arguments came in pieces as they were generated
    call = whole.message.tool_calls[0]
    assert call.function.name == name
    assert json.loads("".join(fragments)) == json.loads(call.function.arguments)
    assert reasons[-1] == "tool_calls"


def test_n2_with_a_named_tool_gives_a_call_per_choice_whole_and_streamed(openai_client):
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, max_tokens=40, temperature=1.0, seed=3, n=2,
                  tools=[WEATHER, TIME], tool_choice=FORCE_WEATHER)
    whole = openai_client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert len(choice.message.tool_calls) == 1 and choice.message.content is None
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                            WEATHER["function"]["parameters"])
    arguments, names, reasons = {0: "", 1: ""}, {}, {}
    for chunk in openai_client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        for tc in choice.delta.tool_calls or []:
            names[choice.index] = tc.function.name or names.get(choice.index)
            arguments[choice.index] += tc.function.arguments or ""
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert names == {0: "get_weather", 1: "get_weather"} and reasons == {0: "stop", 1: "stop"}
    assert [json.loads(arguments[i]) for i in (0, 1)] == [
        json.loads(c.message.tool_calls[0].function.arguments) for c in whole.choices]


def test_tool_calls_and_results_in_the_history_are_in_the_prompt(openai_client):
    from kvmesh.cluster.openai_protocol import ChatMessage, chat_prompt_text
    from kvmesh.cluster.tool_calls import parse_tools, render_chat
    from kvmesh.worker.chat_template import encode_chat
    from kvmesh.worker.loader import load_tokenizer
    from types import SimpleNamespace

    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    r = openai_client.chat.completions.create(model=MODEL, messages=history, max_tokens=30,
                                       temperature=0, tools=[WEATHER])
    tokenizer = load_tokenizer(MODEL)[0]
    ms = [ChatMessage.model_validate(m) for m in history]
    tools = parse_tools(SimpleNamespace(tools=[WEATHER], tool_choice=None, parallel_tool_calls=None))
    rendered, _ = render_chat(ms, chat_prompt_text(ms), tools, tokenizer)
    assert r.usage.prompt_tokens == len(encode_chat(tokenizer, rendered))
    assert "Sunny, 24 C" in rendered[-1]["content"] and "get_weather" in rendered[-2]["content"]
    assert r.choices[0].message.content  # an answer, not an empty turn


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [WEATHER], "stream": True, "logprobs": True}, "logprobs"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_bad_tool_requests_name_the_field(cluster, fields, param):
    code, err, _ = post(cluster, "/v1/chat/completions",
                        {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **fields})
    assert code == 400, err
    assert err["error"]["param"] == param


# ---- gRPC: GenerateRequest.structured_outputs ------------------------------------------------------

def test_grpc_structured_outputs_choice_and_json_schema(cluster):
    from kvmesh.cluster.client import grpc_stream
    from kvmesh.proto import kvmesh_pb2 as pb

    choice = list(grpc_stream(cluster.grpc_target, messages=[{"role": "user", "content": "Is Paris "
                                                               "the capital of Italy?"}],
                              max_tokens=10, temperature=0,
                              structured_outputs=pb.StructuredOutputs(choice=["YES", "NO"])))
    assert "".join(m.text for m in choice) in ("YES", "NO")
    assert choice[-1].finish_reason == "stop"
    schema = list(grpc_stream(cluster.grpc_target, messages=ASK_CITY, max_tokens=80, temperature=0,
                              structured_outputs=pb.StructuredOutputs(json_schema=json.dumps(CITY))))
    jsonschema.validate(json.loads("".join(m.text for m in schema)), CITY)


@pytest.mark.parametrize("spec, field", [
    ({"regex": "(a"}, "structured_outputs"),
    ({"json_schema": "{not json"}, "structured_outputs.json_schema"),
    ({"regex": "a+", "grammar": "root ::= \"a\""}, "structured_outputs"),
])
def test_grpc_bad_structured_outputs_are_invalid_argument_naming_the_field(cluster, spec, field):
    import grpc

    from kvmesh.cluster.client import grpc_stream
    from kvmesh.proto import kvmesh_pb2 as pb

    with pytest.raises(grpc.RpcError) as e:
        list(grpc_stream(cluster.grpc_target, prompt="hi", max_tokens=4,
                         structured_outputs=pb.StructuredOutputs(**spec)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


# ---- gRPC: tools, echo, prompt logprobs -----------------------------------------------------------

def _grpc_tool(tool: dict):
    from kvmesh.proto import kvmesh_pb2 as pb

    fn = tool["function"]
    return pb.Tool(name=fn["name"], description=fn.get("description", ""),
                   parameters=json.dumps(fn["parameters"]))


def _grpc_calls(messages) -> list[dict]:
    calls: dict[int, dict] = {}
    for m in messages:
        for tc in m.tool_calls:
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] = tc.name or call["name"]
            call["arguments"] += tc.arguments
    return [calls[i] for i in sorted(calls)]


def test_grpc_named_tool_choice_streams_a_schema_valid_call(cluster):
    from kvmesh.cluster.client import grpc_stream

    out = list(grpc_stream(cluster.grpc_target, messages=ASK_WEATHER, max_tokens=40, temperature=0,
                           tools=[_grpc_tool(WEATHER), _grpc_tool(TIME)],
                           tool_choice="get_weather"))
    calls = _grpc_calls(out)
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert calls[0]["id"].startswith("chatcmpl-tool-") and "".join(m.text for m in out) == ""
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_grpc_tool_choice_auto_streams_the_call_and_the_content_before_it(cluster):
    from kvmesh.cluster.client import grpc_stream
    from kvmesh.proto import kvmesh_pb2 as pb

    regex, content, name = AUTO_FORMS[0]
    out = list(grpc_stream(cluster.grpc_target, messages=ASK_WEATHER, max_tokens=150,
                           temperature=0, tools=[_grpc_tool(WEATHER), _grpc_tool(TIME)],
                           structured_outputs=pb.StructuredOutputs(regex=regex)))
    assert "".join(m.text for m in out) == content  # no markup
    calls = _grpc_calls(out)
    assert [c["name"] for c in calls] == [name] and json.loads(calls[0]["arguments"])["city"]
    assert sum(1 for m in out if m.tool_calls) > 2  # header, then the arguments in pieces
    assert out[-1].finish_reason == "tool_calls"


def test_grpc_echo_returns_the_prompt_and_its_logprobs(cluster):
    from kvmesh.cluster.client import grpc_stream

    prompt = "The capital of France is"
    out = list(grpc_stream(cluster.grpc_target, prompt=prompt, max_tokens=3, temperature=0,
                           echo=True, logprobs=2))
    first = out[0]
    assert first.prompt_text == prompt and len(first.prompt_token_ids) > 3
    scored = [e for m in out for e in m.prompt_logprobs]
    assert len(scored) == len(first.prompt_token_ids)
    assert not scored[0].HasField("logprob") and all(e.HasField("logprob") for e in scored[1:])
    assert all(e.rank >= 1 and len(e.top) <= 2 for e in scored[1:])
    assert not any(m.prompt_text for m in out[1:])


def test_grpc_json_object_and_grammar_answer_as_http_does(cluster, openai_client):
    """SERVING.md: structured_outputs json_object and grammar over gRPC: the same constrained
    answer as the HTTP request (greedy)."""
    from kvmesh.cluster.client import grpc_stream
    from kvmesh.proto import kvmesh_pb2 as pb

    ask = [{"role": "user", "content": "Answer in JSON: what is the capital of France?"}]
    grammar = 'root ::= city "."\ncity ::= "Paris" | "Rome" | "Oslo"'
    for spec, http_spec, max_tokens in (({"json_object": True}, {"json_object": True}, 60),
                                        ({"grammar": grammar}, {"grammar": grammar}, 10)):
        out = list(grpc_stream(cluster.grpc_target, messages=ask, max_tokens=max_tokens, temperature=0,
                               structured_outputs=pb.StructuredOutputs(**spec)))
        text = "".join(m.text for m in out)
        r = openai_client.chat.completions.create(model=MODEL, messages=ask, max_tokens=max_tokens,
                                                  temperature=0, extra_body={"structured_outputs": http_spec})
        assert text == r.choices[0].message.content, spec
        assert out[-1].finish_reason == r.choices[0].finish_reason == "stop", spec
        if "json_object" in spec:
            assert isinstance(json.loads(text), dict)
        else:
            assert text in ("Paris.", "Rome.", "Oslo.")


def test_grpc_tool_choice_required_gives_the_call_http_gives(cluster, openai_client):
    from kvmesh.cluster.client import grpc_stream

    out = list(grpc_stream(cluster.grpc_target, messages=ASK_WEATHER, max_tokens=80, temperature=0,
                           tools=[_grpc_tool(WEATHER), _grpc_tool(TIME)], tool_choice="required",
                           parallel_tool_calls=False))
    calls = _grpc_calls(out)
    whole = openai_client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=80, temperature=0, tools=[WEATHER, TIME],
        tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls
    assert out[-1].finish_reason == "tool_calls" and len(calls) == len(whole) == 1
    assert calls[0]["name"] == whole[0].function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(whole[0].function.arguments)


def test_grpc_prompt_logprobs_without_echo(cluster):
    """SERVING.md: prompt_logprobs alone (no echo): on the first message with a token, one entry
    per prompt token (the first without a logprob), each with its rank and at most the asked
    alternatives; no prompt text."""
    from kvmesh.cluster.client import grpc_stream

    prompt_ids = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
    out = list(grpc_stream(cluster.grpc_target, prompt_token_ids=prompt_ids, max_tokens=3,
                           temperature=0, prompt_logprobs=3))
    carrying = [i for i, m in enumerate(out) if m.prompt_logprobs]
    assert carrying == [next(i for i, m in enumerate(out) if m.token_ids)]
    scored = list(out[carrying[0]].prompt_logprobs)
    assert len(scored) == len(prompt_ids)
    assert not scored[0].HasField("logprob") and all(e.HasField("logprob") for e in scored[1:])
    assert all(e.rank >= 1 and 1 <= len(e.top) <= 3 for e in scored[1:])
    assert not any(m.prompt_text or m.prompt_token_ids for m in out)


# ---- docs/SERVING.md "Structured outputs and tool calls" (the rest: tests/unit/test_doc_claims_serving_ops.py)

def test_an_ebnf_grammar_as_xgrammar_reads_it_constrains_the_answer(openai_client):
    """"`grammar` is EBNF (GBNF) as xgrammar reads it": rule references and alternatives."""
    grammar = 'root ::= city "."\ncity ::= "Paris" | "Rome" | "Oslo"'
    r = openai_client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of Norway?"}],
        extra_body={"structured_outputs": {"grammar": grammar}})
    assert r.choices[0].message.content in ("Paris.", "Rome.", "Oslo.")
    assert r.choices[0].finish_reason == "stop"


# "a" can start it (so the ingress accepts it); after "a" no token fits.
DEAD_END = {"model": MODEL, "messages": ASK_CITY, "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"regex": "a[^\\s\\S]"}}


def test_a_grammar_that_leads_nowhere_after_some_tokens_ends_the_stream_with_finish_reason_error(cluster):
    """"A grammar that leads, after some tokens, where no token fits ends its request with
    `finish_reason: "error"`" (streamed: the last chunk, then `data: [DONE]`)."""
    import urllib.request

    req = urllib.request.Request(cluster.http_url + "/v1/chat/completions",
                                 json.dumps({**DEAD_END, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        events = [line[len("data: "):] for line in resp.read().decode().split("\n")
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "a"
    assert [c["finish_reason"] for c in choices][-1] == "error"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_a_grammar_that_leads_nowhere_after_some_tokens_fails_a_whole_request_with_a_400(cluster):
    """Not streamed, the same request is refused as the request's fault (400 naming
    `structured_outputs`, no Retry-After: it would fail the same way again), docs/SERVING.md
    "Structured outputs"."""
    code, err, headers = post(cluster, "/v1/chat/completions", DEAD_END)
    assert code == 400, err
    assert err["error"]["param"] == "structured_outputs" and "Retry-After" not in headers
    assert "the grammar allows no token" in err["error"]["message"]


# ---- docs/SERVING.md "Errors": rows no other test checks exactly (any served model will do) -------

def _raw_post(cluster, raw: bytes):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(cluster.http_url + "/v1/chat/completions", raw,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_a_body_that_is_not_json_is_a_400_with_a_null_param_saying_so(cluster):
    """"a body that is not JSON ... | 400 | `param` null; the message says the body is not valid
    JSON"."""
    status, body = _raw_post(cluster, b'{"model": "' + MODEL.encode() + b'", "messages": [')
    assert status == 400 and body["error"]["param"] is None, body
    assert "not valid JSON" in body["error"]["message"]


def test_an_unpaired_surrogate_is_a_400_naming_the_fields_path(cluster):
    """"a string with an unpaired UTF-16 surrogate (`"\\ud800"`) | 400 | the field's path, e.g.
    `messages.0.content`"."""
    raw = ('{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800"}]}'
           % MODEL).encode()
    status, body = _raw_post(cluster, raw)
    assert status == 400 and body["error"]["param"] == "messages.0.content", body


# ---- the README's answers on the default model ---------------------------------------------------

def test_the_readme_s_client_and_curl_answers_name_paris(cluster):
    """README: `kvmesh client "What is the capital of France?"` (HTTP, and --grpc) and the curl body
    it gives answer "The capital of France is Paris." on the default model, served."""
    import os
    import subprocess
    import sys

    question = "What is the capital of France?"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    for where in (["--url", cluster.http_url + "/v1"], ["--grpc", "--target", cluster.grpc_target]):
        run = subprocess.run([sys.executable, "-m", "kvmesh.cli", "client", question, *where],
                             capture_output=True, timeout=300, env=env)
        assert run.returncode == 0, run.stderr.decode(errors="replace")
        assert "The capital of France is Paris." in run.stdout.decode(), (where, run.stdout)
    status, body, _ = post(cluster, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0})
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"], body


# ---- tool calls on the Responses API (cluster/responses_api.py) ---------------------------------

def test_a_responses_tool_call_is_the_chats_streamed_or_not(cluster, openai_client):
    """tool_choice required on the same prompt at temperature 0: the chat's call (name and
    arguments) as a function_call item, whole and as streamed events (each as the official client's
    types define it); then the call and its result sent back as input items are answered."""
    from pydantic import TypeAdapter
    from openai.types.responses import ResponseStreamEvent

    chat = openai_client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=80,
                                                 temperature=0, tools=[WEATHER], tool_choice="required",
                                                 parallel_tool_calls=False)
    [expected] = chat.choices[0].message.tool_calls
    body = {"model": MODEL, "input": ASK_WEATHER[0]["content"], "max_output_tokens": 80, "temperature": 0,
            "tools": [{"type": "function", **WEATHER["function"]}], "tool_choice": "required",
            "parallel_tool_calls": False}
    r = openai_client.responses.create(**body)
    [call] = r.output
    assert call.type == "function_call" and r.status == "completed"
    assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)
    assert call.id.startswith("fc_") and call.status == "completed"
    events = responses_events(cluster, body)
    adapter = TypeAdapter(ResponseStreamEvent)
    for _, data in events:
        adapter.validate_python(data)
    kinds = [name for name, _ in events]
    assert kinds[2] == "response.output_item.added" and events[2][1]["item"]["type"] == "function_call"
    fragments = "".join(data["delta"] for name, data in events if name == "response.function_call_arguments.delta")
    done = next(data for name, data in events if name == "response.function_call_arguments.done")
    assert fragments == done["arguments"] and done["name"] == call.name
    assert json.loads(done["arguments"]) == json.loads(call.arguments)
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    follow_up = openai_client.responses.create(
        model=MODEL, max_output_tokens=16, temperature=0, tools=body["tools"],
        input=[{"role": "user", "content": ASK_WEATHER[0]["content"]},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert follow_up.usage.input_tokens > r.usage.input_tokens and follow_up.usage.output_tokens > 0
