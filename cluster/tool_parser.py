"""Tool calling, output side: a completion's text read into OpenAI `tool_calls`, whole or streamed.

Forms read with `tool_choice: auto` (whichever the text has):
- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call,
  text before the first block is the message content;
- Llama 3 JSON: the whole output is `{"name": ..., "parameters": {...}}` (or "arguments"), or
  several separated by `;`, optionally after `<|python_tag|>`.
Text that does not parse as calls stays content (as vLLM's parsers do). With `required` the output
is the JSON array the grammar enforced, and with a named function it is that function's arguments.

Streaming follows vLLM's deltas: a call's first delta has its index, id, type and name (arguments
""), the next ones add to `function.arguments`. A named function's arguments stream as they are
generated, and so do `required` calls (a call's header once its name is complete, then its
parameters' text) and `auto` calls, Hermes or Llama 3 (tool_call_scan.py: the header once the
name is complete, then the arguments' text as it comes; content before a `<tool_call>` streams as
it comes, the markup never).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kvmesh.cluster.tool_call_scan import OPEN, PYTHON_TAG, AutoCalls
from kvmesh.cluster.tool_calls import ToolRequest

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex}"

    def body(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse_output(text: str, request: ToolRequest) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output."""
    if request.choice == "function":
        return None, [ToolCall(request.function_name, text)]
    if request.choice == "required":
        calls = _json_calls(text, array=True)
        return (None, calls) if calls else (text, [])
    if request.choice == "none":
        return text, []
    return parse_auto(text)


def parse_auto(text: str) -> tuple[str | None, list[ToolCall]]:
    if OPEN in text:
        calls = []
        for body in _HERMES.findall(text):
            call = _call(_loads(body))
            if call is None:
                return text, []
            calls.append(call)
        content = text[:text.index(OPEN)].strip()
        return content or None, calls
    stripped = text.strip()
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG):].lstrip()
    if stripped.startswith("{"):
        calls = _json_calls(stripped, array=False)
        if calls:
            return None, calls
    return text, []


def finish_reason(reason: str | None, request: ToolRequest, calls: list[ToolCall]) -> str | None:
    """vLLM's: "tool_calls" when auto or required produced calls; a named function keeps the
    engine's reason (as OpenAI does for a forced function)."""
    if calls and request.choice in ("auto", "required") and reason == "stop":
        return "tool_calls"
    return reason


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(text: str, array: bool) -> list[ToolCall]:
    if array:
        items = _loads(text)
        items = items if isinstance(items, list) else []
    else:  # one object, or several separated by ";"
        items, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(text):
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return []
            items.append(obj)
            rest = text[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return []
            pos = len(text) - len(rest)
    calls = [_call(item) for item in items]
    return calls if calls and all(c is not None for c in calls) else []


class ToolStream:
    """One streamed output's deltas: `feed` each text piece, then `finish` once; each returns the
    chat `delta` objects to send (content and/or tool_calls)."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.calls: list[ToolCall] = []
        self._text = ""  # the whole output so far
        self._streamed: list[dict] = []  # required: per call, its id and the arguments sent
        self._auto = AutoCalls(lambda name: ToolCall(name, "")) if request.choice == "auto" else None

    def feed(self, piece: str) -> list[dict]:
        self._text += piece
        choice = self.request.choice
        if choice == "function":
            out = []
            if not self.calls:
                self.calls.append(ToolCall(self.request.function_name, ""))
                out.append({"tool_calls": [{"index": 0, **self.calls[0].body()}]})
            if piece:
                self.calls[0].arguments += piece
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        if choice == "required":
            return self._required_deltas()
        if choice == "none":
            return [{"content": piece}] if piece else []
        out = self._auto.feed(piece)
        self.calls = self._auto.calls
        return out

    def finish(self) -> list[dict]:
        choice = self.request.choice
        if choice in ("function", "none"):
            return []
        if choice == "auto":
            out = self._auto.finish()
            self.calls = self._auto.calls
            return out
        content, calls = parse_output(self._text, self.request)
        if self._streamed:  # sent as generated: only what is still missing
            out = self._required_deltas()
            for call, sent in zip(calls, self._streamed):
                call.id = sent["id"]
            self.calls = calls  # none when the output was cut short (finish_reason length)
            return out
        if not calls:
            return [{"content": self._text}] if self._text else []
        self.calls = calls
        out = []
        for i, call in enumerate(calls):
            out.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        return out

    def _required_deltas(self) -> list[dict]:
        """`required`: the grammar's array of {"name", "parameters"} read as it grows; a call's
        header goes once its name is complete, then its parameters' text as it comes."""
        out = []
        for i, (name, params) in enumerate(_scan_calls(self._text)):
            if name is None:
                break
            if i == len(self._streamed):
                self._streamed.append({"id": ToolCall(name, "").id, "sent": 0})
                out.append({"tool_calls": [{"index": i, "id": self._streamed[i]["id"],
                                            "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            sent = self._streamed[i]["sent"]
            if len(params) > sent:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": params[sent:]}}]})
                self._streamed[i]["sent"] = len(params)
        return out


def _scan_calls(text: str) -> list[tuple[str | None, str]]:
    """The calls of a (growing) JSON array of {"name": ..., "parameters": {...}}: each call's name
    (None until its string is complete) and the raw text of its parameters so far."""
    calls: list[list] = []
    depth, in_string, escaped = 0, False, False
    key, key_start, value_start, expect = None, -1, -1, None  # at depth 2: the element's keys
    for pos, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and expect == "key":
                    key, expect = text[key_start + 1:pos], "colon"
                elif depth == 2 and expect == "name":
                    calls[-1][0], expect = json.loads(text[value_start:pos + 1]), None
            continue
        if ch == '"':
            in_string = True
            if depth == 2 and expect in (None, "key") and key is None:
                key_start, expect = pos, "key"
            elif depth == 2 and expect == "value" and key == "name":
                value_start, expect = pos, "name"
        elif ch == ":" and depth == 2 and expect == "colon":
            expect = "value"
        elif ch in "[{":
            depth += 1
            if depth == 2 and ch == "{":
                calls.append([None, ""])
                key, expect = None, None
            elif depth == 3 and expect == "value" and key == "parameters":
                value_start, expect = pos, "parameters"
        elif ch in "]}":
            if depth == 3 and expect == "parameters":
                calls[-1][1], expect = text[value_start:pos + 1], "done"
            depth -= 1
        elif ch == "," and depth == 2:
            key, expect = None, None
    if expect == "parameters":  # still being written
        calls[-1][1] = text[value_start:]
    return [(name, params) for name, params in calls]
