"""`tool_choice: auto` calls streamed as they are generated (cluster/tool_call_scan.py): whatever
the pieces the output arrives in (split at every character position, or one character at a time),
a call's first delta carries index, id, type and name with arguments "", its argument fragments
join to exactly its final arguments (equal as JSON to the whole-output parse), the content before
`<tool_call>` streams as content, and the markup is never content."""

import json
from types import SimpleNamespace

import pytest

from kvmesh.cluster.tool_call_scan import CallScan
from kvmesh.cluster.tool_calls import parse_tools
from kvmesh.cluster.tool_parser import ToolStream, parse_auto

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
AUTO = SimpleNamespace(tools=[WEATHER, TIME], tool_choice="auto", parallel_tool_calls=None)

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"r}is", '
          '"days": [1, {"x": null}], "ok": true}}\n</tool_call>\n<tool_call>\n{"arguments": {}, '
          '"name": "get_time"}\n</tool_call>')
LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo}", "n": 2}}; '
         '{"name": "get_time"}')
STRING_ARGS = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
OUTPUTS = [HERMES, LLAMA, STRING_ARGS]


def _stream(pieces):
    stream = ToolStream(parse_tools(AUTO))
    deltas = []
    for piece in pieces:
        deltas.append(stream.feed(piece))
    deltas.append(stream.finish())
    return stream, deltas


def _check(text, stream, deltas):
    flat = [d for batch in deltas for d in batch]
    content = "".join(d.get("content", "") for d in flat)
    whole_content, whole_calls = parse_auto(text)
    assert content.strip() == (whole_content or "")
    assert "<tool_call>" not in content and "<|python_tag|>" not in content
    fragments: dict[int, list[str]] = {}
    for d in flat:
        for tc in d.get("tool_calls", []):
            i = tc["index"]
            if i not in fragments:  # a call's first delta: its header
                assert tc["type"] == "function" and tc["id"].startswith("chatcmpl-tool-")
                assert tc["function"]["arguments"] == ""
                assert tc["function"]["name"] == whole_calls[i].name
                fragments[i] = []
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                fragments[i].append(tc["function"]["arguments"])
    assert sorted(fragments) == list(range(len(whole_calls)))
    for i, call in enumerate(stream.calls):
        assert "".join(fragments[i]) == call.arguments
        assert json.loads(call.arguments) == json.loads(whole_calls[i].arguments)


@pytest.mark.parametrize("text", OUTPUTS, ids=["hermes", "llama3", "string-arguments"])
def test_split_at_every_position_the_fragments_join_to_the_final_arguments(text):
    for cut in range(len(text) + 1):
        stream, deltas = _stream([text[:cut], text[cut:]])
        _check(text, stream, deltas)


@pytest.mark.parametrize("text", OUTPUTS, ids=["hermes", "llama3", "string-arguments"])
def test_one_character_at_a_time(text):
    stream, deltas = _stream(list(text))
    _check(text, stream, deltas)


def test_a_call_header_goes_as_soon_as_its_name_is_complete_and_arguments_as_generated():
    stream = ToolStream(parse_tools(AUTO))
    assert stream.feed("Sure.\n<tool_") == [{"content": "Sure.\n"}]  # the tail may be markup
    assert stream.feed('call>\n{"name": "get_wea') == []
    header = stream.feed('ther", "arguments": {"ci')
    assert header[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert header[1]["tool_calls"][0]["function"] == {"arguments": '{"ci'}
    assert stream.feed('ty": "Rome"}}\n</tool_call>') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]}]
    assert stream.finish() == []
    assert [c.arguments for c in stream.calls] == ['{"city": "Rome"}']


def test_an_output_cut_short_after_a_call_name_keeps_the_call():
    # what was sent stays sent (SERVING.md): the header went out, so the call stays a call
    stream = ToolStream(parse_tools(AUTO))
    sent = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro')
    assert sent[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert stream.finish() == []  # no content after the fact
    assert [c.name for c in stream.calls] == ["get_weather"]


@pytest.mark.parametrize("cut", ['<tool_call>\n{"name": "get_wea', '<tool_call>\n{"arguments": {"a": 1}, "na'])
def test_an_output_cut_short_before_a_call_name_was_complete_is_content(cut):
    stream = ToolStream(parse_tools(AUTO))
    sent = [d for d in stream.feed(cut) + stream.finish()]
    assert "".join(d.get("content", "") for d in sent) == cut  # as the whole-output parse reads it
    assert not any("tool_calls" in d for d in sent) and stream.calls == []
    assert parse_auto(cut) == (cut, [])


@pytest.mark.parametrize("text", ["Paris is sunny.", '{"city": "Paris"}', "<tool_call>{not json}</tool_call>",
                                  "a < b <tool_ca", '<|python_tag|>{"city": 1}'])
def test_text_that_is_no_call_is_content_whatever_the_split(text):
    for cut in range(len(text) + 1):
        stream, deltas = _stream([text[:cut], text[cut:]])
        assert "".join(d.get("content", "") for b in deltas for d in b) == text
        assert stream.calls == []


def test_call_scan_reads_one_object_and_stops_at_its_end():
    scan = CallScan()
    rest = ' {"name": "f", "x": -1.5e3, "arguments": {"a": "}"}} ; {"name": "g"}'
    used = scan.feed(rest)
    assert scan.done and rest[used:] == ' ; {"name": "g"}'
    assert scan.name == "f" and scan.final_arguments() == '{"a": "}"}'
    bad = CallScan()
    bad.feed("[1, 2]")
    assert bad.invalid
