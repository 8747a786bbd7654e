"""The Responses API's request translation and response shaping (cluster/responses_api.py), as
docs/SERVING.md states them; the endpoint itself, streamed and not, against the chat path and the
offline engine: tests/integration/test_cluster_serving.py."""

import pytest

from kvmesh.cluster.openai_protocol import ApiError, ChatCompletionRequest, parse_request
from kvmesh.cluster.response_store import StoredResponses, owner_of
from kvmesh.cluster.responses_api import (ResponseShaper, chat_body, in_responses_terms, item_page,
                                          response_body)


def test_input_string_instructions_and_limits_become_the_chat_request():
    chat = chat_body({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9,
                      "temperature": 0.5, "top_p": 0.9, "user": "u", "stream": True, "seed": 3,
                      "stop": ["\n"], "top_k": 4, "metadata": {"k": "v"}, "store": False,
                      "tool_choice": "auto", "truncation": "disabled", "parallel_tool_calls": True,
                      "priority": -2, "cache_salt": "tenant"})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi"}],
                    "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "user": "u",
                    "seed": 3, "stop": ["\n"], "top_k": 4, "priority": -2, "cache_salt": "tenant",
                    "stream": True}
    parse_request(chat, ChatCompletionRequest)  # a valid chat request


def test_message_items_with_text_parts_and_developer_as_system():
    chat = chat_body({"model": "m", "input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}]})
    assert chat["messages"] == [{"role": "system", "content": "Rules."}, {"role": "user", "content": "ab"},
                                {"role": "assistant", "content": "c"}]


@pytest.mark.parametrize("text,expected", [
    (None, None), ({"format": {"type": "text"}}, None), ({"format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}},
     {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}})])
def test_text_format_is_the_chats_response_format(text, expected):
    body = {"model": "m", "input": "x"}
    if text is not None:
        body["text"] = text
    assert chat_body(body).get("response_format") == expected


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function"}]}, "tools.1.name"),
    ({"tools": {"type": "function", "name": "f"}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "lots"}}, "reasoning.effort"),
    ({"reasoning": {"effort": "low", "summary": "long"}}, "reasoning.summary"),
    ({"reasoning": {"budget": 100}}, "reasoning.budget"),
    ({"reasoning": "low"}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include.1"),
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": True}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "tools": [{"type": "function", "name": "f"}]}, "include"),
    ({"store": "yes"}, "store"),
    ({"background": True}, "background"),  # not stored
    ({"background": True, "store": True, "stream": True}, "background"),
    ({"background": "yes"}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"stream": "yes"}, "stream"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input.0.arguments"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": []}]}, "input.0.role"),
    ({"input": [{"role": "user"}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
    ({"instructions": 3}, "instructions"),
])
def test_what_it_cannot_honour_is_a_400_naming_the_field(extra, param):
    with pytest.raises(ApiError) as e:
        chat_body({"model": "m", "input": "x", **extra})
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    assert e.value.message.startswith(param)


def test_model_is_required_and_the_body_is_an_object():
    with pytest.raises(ApiError) as e:
        chat_body({"input": "x"})
    assert e.value.param == "model"
    with pytest.raises(ApiError):
        chat_body(["x"])


def test_chat_errors_are_named_in_the_responses_fields():
    body = {"model": "m", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "instructions": "s"}
    e = in_responses_terms(ApiError(400, "max_completion_tokens is 9 but only 3 are left",
                                    param="max_completion_tokens"), body)
    assert (e.param, e.message) == ("max_output_tokens", "max_output_tokens is 9 but only 3 are left")
    e = in_responses_terms(ApiError(400, "messages.2.content: too long", param="messages.2.content"), body)
    assert (e.param, e.message) == ("input.1.content", "input.1.content: too long")  # instructions: messages.0
    e = in_responses_terms(ApiError(400, "response_format: bad", param="response_format"), body)
    assert e.param == "text.format"
    e = in_responses_terms(ApiError(400, "response_format.json_schema.schema: bad",
                                    param="response_format.json_schema.schema"), body)
    assert (e.param, e.message) == ("text.format.schema", "text.format.schema: bad")
    e = in_responses_terms(ApiError(400, "a function's parameters must be a JSON schema object",
                                    param="tools.0.function.parameters"), body)
    assert e.param == "tools.0.parameters"
    e = in_responses_terms(ApiError(503, "no worker", type="service_unavailable", retry_after_s=2), body)
    assert (e.status, e.param, e.type, e.retry_after_s) == (503, None, "service_unavailable", 2)
    assert in_responses_terms(ApiError(400, "the request body must be a JSON object"), ["x"]).status == 400


def chat_completion(content, finish_reason, cached=0):
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def test_a_finished_chat_is_a_completed_response_object():
    request = {"model": "m", "input": "x", "metadata": {"k": "v"}, "temperature": 0.3}
    shaper = ResponseShaper(request, "served-name", 1700000000)
    body = response_body(shaper, chat_completion("Paris.", "stop", cached=4))
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["status"] == "completed"
    assert body["model"] == "served-name" and body["created_at"] == 1700000000
    assert body["store"] is False and body["metadata"] == {"k": "v"} and body["temperature"] == 0.3
    assert body["incomplete_details"] is None and body["error"] is None
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "text": "Paris.", "annotations": [], "logprobs": []}]
    assert body["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                             "output_tokens": 5,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}


def test_a_chat_cut_by_length_is_incomplete_for_max_output_tokens():
    body = response_body(ResponseShaper({"model": "m", "input": "x"}, "m", 0), chat_completion("Par", "length"))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"


def test_the_official_client_parses_the_response_object():
    from openai.types.responses import Response

    shaper = ResponseShaper({"model": "m", "input": "x"}, "m", 0)
    parsed = Response.model_validate(response_body(shaper, chat_completion("Paris.", "stop")))
    assert parsed.output_text == "Paris." and parsed.usage.output_tokens == 5


def test_a_previous_responses_output_items_can_be_sent_back_as_input():
    """What a client does to continue a conversation without stored responses: input = the
    earlier input + response.output (items with id, status, annotations and logprobs)."""
    shaper = ResponseShaper({"model": "m", "input": "Hi"}, "m", 0)
    earlier = response_body(shaper, chat_completion("Hello!", "stop"))
    chat = chat_body({"model": "m", "input": [{"role": "user", "content": "Hi"}, *earlier["output"],
                                              {"role": "user", "content": "Bye"}]})
    assert chat["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "Bye"}]


def test_function_tools_and_calls_become_the_chats_tools_and_tool_messages():
    tool = {"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"},
            "strict": True}
    chat = chat_body({"model": "m", "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"},
                      "parallel_tool_calls": False, "input": [
                          {"role": "user", "content": "Weather in Paris and Rome?"},
                          {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                          {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
                          {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                          {"type": "function_call_output", "call_id": "c2", "output": "rain"}]})
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                               "parameters": {"type": "object"}, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [  # two parallel calls: one message
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    parse_request(chat, ChatCompletionRequest)
    for choice in ("auto", "none", "required"):
        assert chat_body({"model": "m", "input": "x", "tools": [tool], "tool_choice": choice})["tool_choice"] == choice
    assert "tool_choice" not in chat_body({"model": "m", "input": "x", "tool_choice": "auto"})  # no tools


def test_a_chats_tool_calls_are_function_call_items_after_its_message():
    shaper = ResponseShaper({"model": "m", "input": "x"}, "m", 0)
    chat = chat_completion(None, "tool_calls")
    chat["choices"][0]["message"]["tool_calls"] = [
        {"id": "chatcmpl-tool-abc", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    body = response_body(shaper, chat)
    assert body["status"] == "completed"
    assert body["output"] == [{"type": "function_call", "id": "fc_abc", "call_id": "chatcmpl-tool-abc",
                               "name": "f", "arguments": "{}", "status": "completed"}]
    chat["choices"][0]["message"]["content"] = "Let me look."
    assert [item["type"] for item in response_body(shaper, chat)["output"]] == ["message", "function_call"]
    from openai.types.responses import Response
    assert Response.model_validate(response_body(shaper, chat)).output[1].name == "f"


# ---- logprobs (include message.output_text.logprobs, top_logprobs) ---------------------------------

LOGPROBS = ["message.output_text.logprobs"]


def test_included_logprobs_are_the_chats_logprobs_with_top_logprobs_alternatives():
    assert chat_body({"model": "m", "input": "x", "include": LOGPROBS, "top_logprobs": 3}) | {"messages": []} == {
        "model": "m", "messages": [], "logprobs": True, "top_logprobs": 3}
    assert chat_body({"model": "m", "input": "x", "include": LOGPROBS})["top_logprobs"] == 0
    assert "logprobs" not in chat_body({"model": "m", "input": "x", "include": [], "top_logprobs": 0})
    tools = [{"type": "function", "name": "f"}]  # the model may not call them: the text is the output
    assert chat_body({"model": "m", "input": "x", "include": LOGPROBS, "tools": tools,
                      "tool_choice": "none"})["logprobs"] is True


def test_a_chats_logprobs_are_the_output_texts_and_the_client_parses_them():
    from openai.types.responses import Response

    entries = [{"token": "Par", "logprob": -0.5, "bytes": [80, 97, 114],
                "top_logprobs": [{"token": "Par", "logprob": -0.5, "bytes": [80, 97, 114]}]},
               {"token": "is", "logprob": -0.1, "bytes": [105, 115], "top_logprobs": []}]
    chat = chat_completion("Paris", "stop")
    chat["choices"][0]["logprobs"] = {"content": entries}
    body = response_body(ResponseShaper({"model": "m", "input": "x", "top_logprobs": 1}, "m", 0), chat)
    assert body["output"][0]["content"][0]["logprobs"] == entries and body["top_logprobs"] == 1
    parsed = Response.model_validate(body)
    assert [lp.logprob for lp in parsed.output[0].content[0].logprobs] == [-0.5, -0.1]


# ---- stored responses (server.responses_store) ------------------------------------------------------

def test_store_true_is_taken_when_the_server_stores_and_the_response_says_so():
    body = {"model": "m", "input": "x", "store": True}
    chat_body(body, store=True)
    shaper = ResponseShaper(body, "m", 0)
    assert shaper.stored and response_body(shaper, chat_completion("y", "stop"))["store"] is True
    assert not ResponseShaper({"model": "m", "input": "x"}, "m", 0).stored  # left out: not stored


def test_a_previous_responses_conversation_runs_before_the_input_and_its_instructions_do_not():
    store = StoredResponses()
    first = {"model": "m", "input": "Hi", "instructions": "Be brief.", "store": True}
    shaper = ResponseShaper(first, "m", 0)
    out = response_body(shaper, chat_completion("Hello!", "stop"))
    store.put(out, shaper.inputs, "", 10)
    _, earlier = store.get(out["id"], "")
    assert [(item["type"], item["role"]) for item in earlier] == [("message", "user"), ("message", "assistant")]
    second = {"model": "m", "input": [{"role": "user", "content": "Bye"}], "instructions": "Rhyme.",
              "previous_response_id": out["id"]}
    chat = chat_body(second, earlier, store=True)
    assert chat["messages"] == [{"role": "system", "content": "Rhyme."}, {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    again = ResponseShaper(second, "m", 0, earlier)
    out2 = response_body(again, chat_completion("Bye!", "stop"))
    assert out2["previous_response_id"] == out["id"]
    # the chat's messages.3 is the input's first item: after the instructions and two earlier messages
    e = in_responses_terms(ApiError(400, "messages.3.content: too long", param="messages.3.content"),
                           second, earlier)
    assert e.param == "input.0.content"
    # a third turn continues the whole chain: conversations nest
    store.put(out2, again.inputs, "", 10)
    third = store.get(out2["id"], "")[1]
    assert [m["content"] for m in chat_body({"model": "m", "input": "Again"}, third, store=True)["messages"]] == [
        "Hi", "Hello!", "Bye", "Bye!", "Again"]
    # an unfinished one has no conversation to continue
    store.put({"id": "r", "status": "failed", "output": []}, [], "", 10)
    assert store.get("r", "")[1] is None


def test_input_items_are_listed_with_ids_newest_first_in_pages():
    from pydantic import TypeAdapter
    from openai.types.responses import ResponseItem

    shaper = ResponseShaper({"model": "m", "input": [
        {"role": "developer", "content": "Rules."}, {"role": "assistant", "content": "ok"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "user", "content": [{"type": "input_text", "text": "Go"}]}]}, "m", 0)
    items = shaper.inputs
    assert items is shaper.inputs  # made once: the same ids each time
    for item in items:
        TypeAdapter(ResponseItem).validate_python(item)  # as the official client reads a listed item
    assert len({item["id"] for item in items}) == 5
    assert items[0]["content"] == [{"type": "input_text", "text": "Rules."}]
    page = item_page(items, None, None, None)
    assert page["data"] == items[::-1] and page["has_more"] is False  # desc by default
    page = item_page(items, "2", "asc", None)
    assert page["data"] == items[:2] and page["has_more"] and page["last_id"] == items[1]["id"]
    page = item_page(items, "2", "asc", page["last_id"])
    assert page["data"] == items[2:4] and page["first_id"] == items[2]["id"]
    for limit, order, after, param in (("0", None, None, "limit"), ("x", None, None, "limit"),
                                       ("101", None, None, "limit"), (None, "up", None, "order"),
                                       (None, None, "msg_nope", "after")):
        with pytest.raises(ApiError) as e:
            item_page(items, limit, order, after)
        assert e.value.param == param


def test_the_store_keeps_the_newest_up_to_its_capacity_each_for_its_owner():
    store = StoredResponses()
    for i in range(3):
        store.put({"id": f"r{i}"}, [i], owner="a", capacity=2)
    assert len(store) == 2 and store.get("r0", "a") is None  # the oldest went
    assert store.get("r1", "a") == ({"id": "r1"}, None)  # a read keeps it: r2 is now the oldest
    assert store.inputs("r1", "a") == [1]
    store.put({"id": "r3"}, [3], owner="a", capacity=2)
    assert store.get("r2", "a") is None and store.get("r1", "a") is not None
    assert store.get("r1", "b") is None and not store.delete("r1", "b")  # another key finds nothing
    assert store.delete("r1", "a") and store.get("r1", "a") is None and not store.delete("r1", "a")


def test_an_owner_is_a_digest_of_the_api_key_never_the_key():
    assert owner_of(None) == owner_of("") == ""
    assert owner_of("sk-a") != owner_of("sk-b") and owner_of("sk-a") == owner_of("sk-a")
    assert "sk-a" not in owner_of("sk-a") and len(owner_of("sk-a")) == 64


def test_a_background_response_runs_until_cancelled_or_its_runner_goes_quiet():
    now = [0.0]
    store = StoredResponses(clock=lambda: now[0])
    store.put({"id": "bg", "status": "queued"}, [], owner="a", capacity=10, background=True)
    assert store.touch("bg", {"id": "bg", "status": "in_progress"}) is False  # runs on
    now[0] = 10.0
    assert store.get("bg", "a") == ({"id": "bg", "status": "in_progress"}, None)  # not finished: no conversation
    assert store.cancel("bg", "b") is None  # another key's: not found
    assert store.cancel("bg", "a")["status"] == "cancelled"
    assert store.touch("bg") is True  # its runner hears it and stops
    assert store.finish({"id": "bg", "status": "completed"}) is False  # and cannot overwrite it
    assert store.get("bg", "a")[0]["status"] == "cancelled"
    # a runner that stops touching (its ingress replica died) leaves a failed response
    store.put({"id": "lost", "status": "queued"}, [], owner="a", capacity=10, background=True)
    now[0] = 10.0 + 16
    lost = store.get("lost", "a")[0]
    assert lost["status"] == "failed" and "stopped" in lost["error"]["message"]
    # one that finishes is stored whole; cancelling it then returns it as it is
    store.put({"id": "ok", "status": "queued"}, ["turn"], owner="a", capacity=10, background=True)
    assert store.finish({"id": "ok", "status": "completed", "output": ["answer"]}) is True
    assert store.cancel("ok", "a")["status"] == "completed"
    assert store.get("ok", "a")[1] == ["turn", "answer"]  # its conversation: input, then output
    store.put({"id": "fg", "status": "completed", "output": []}, ["t"], owner="a", capacity=10)
    assert store.cancel("fg", "a") == "not_background"
    assert store.delete("ok", "a") and store.touch("ok") is True  # deleted: its runner would stop


# ---- streamed events: the logprobs of tokens whose text comes later ------------------------------

class Deltas:
    """A finished request's deltas as the pipeline's DeltaStream hands them to sse_events (the
    cluster runs the real one: tests/integration/test_cluster_serving.py)."""

    def __init__(self, deltas):
        from types import SimpleNamespace

        self.deltas, self.routed = deltas, SimpleNamespace(num_prompt_tokens=3)
        self.num_tokens = sum(len(d.token_ids) for d in deltas)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    def __aiter__(self):
        async def each():
            for delta in self.deltas:
                yield delta
        return each()


def test_a_tokens_logprobs_wait_for_its_text_and_none_is_lost():
    """A character cut between two tokens: the first delta has a token and no text; its logprob
    goes out with the next text delta, and the done event and the response hold every token's."""
    import asyncio
    import json

    from kvmesh.cluster.responses_api import sse_events
    from kvmesh.protocol import TokenDelta

    deltas = [TokenDelta("r", [1], ""), TokenDelta("r", [2], "é"), TokenDelta("r", [3], "!", finish_reason="stop",
                                                                                num_prompt_tokens=3)]
    entries = {t: {"token": f"t{t}", "logprob": -t, "bytes": [], "top_logprobs": []} for t in (1, 2, 3)}

    async def collect():
        shaper = ResponseShaper({"model": "m", "input": "x"}, "m", 0)
        out = []
        async for raw in sse_events(Deltas(deltas), shaper, None, lambda d: [entries[t] for t in d.token_ids]):
            out.append(json.loads(raw.decode().split("data: ", 1)[1]))
        return out

    events = asyncio.run(collect())
    text_deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in text_deltas] == ["é", "!"]
    assert [[lp["token"] for lp in e["logprobs"]] for e in text_deltas] == [["t1", "t2"], ["t3"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [lp["token"] for lp in done["logprobs"]] == ["t1", "t2", "t3"]
    final = events[-1]["response"]["output"][0]["content"][0]
    assert final["text"] == "é!" and [lp["token"] for lp in final["logprobs"]] == ["t1", "t2", "t3"]


def test_a_reasoning_item_sent_back_is_taken_and_not_rendered():
    """docs/SERVING.md "Reasoning models": an earlier answer's reasoning item in the input."""
    earlier = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "thinking"}]}
    chat = chat_body({"model": "m", "input": [{"role": "user", "content": "a"}, earlier,
                                              {"role": "assistant", "content": "b"},
                                              {"role": "user", "content": "c"}]})
    assert chat["messages"] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                {"role": "user", "content": "c"}]


def test_reasoning_effort_is_the_chats_and_the_response_echoes_the_settings():
    """docs/SERVING.md "Reasoning models": OpenAI's reasoning.effort on /v1/responses is the chat's
    reasoning_effort; a summary is taken (none is written)."""
    body = {"model": "m", "input": "x", "reasoning": {"effort": "none", "summary": "auto"}}
    assert chat_body(body)["reasoning_effort"] == "none"
    assert "reasoning_effort" not in chat_body({"model": "m", "input": "x", "reasoning": {"summary": "auto"}})
    shaper = ResponseShaper(body, "m", 0)
    assert shaper.response("completed", [])["reasoning"] == {"effort": "none", "summary": "auto"}
    assert ResponseShaper({"model": "m", "input": "x"}, "m", 0).response("completed", [])["reasoning"] is None
