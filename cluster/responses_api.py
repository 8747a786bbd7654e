"""OpenAI's Responses API (`POST /v1/responses`), text and function tools, over the chat pipeline.

A request is checked and turned into the chat completion it asks for (`chat_body`): `input` (a
string, or a list of messages whose content is a string or input_text / output_text parts) after
`instructions` as a system message, `max_output_tokens`, `temperature`, `top_p`, `text.format`
(text, json_object, json_schema: the chat's response_format), `user`, `stream`, the token logprobs
of `include: ["message.output_text.logprobs"]` with `top_logprobs` alternatives, and vLLM's
sampling fields (seed, stop, top_k, min_p, penalties), `priority`, `cache_salt`, `structured_outputs`,
`include_reasoning` and `chat_template_kwargs`; `reasoning.effort` is the chat's reasoning_effort. Function `tools`, `tool_choice` and
`parallel_tool_calls` are the chat's (its parsers and grammars, cluster/tool_calls.py), and
`function_call` / `function_call_output` input items are an assistant's tool calls and their tool
messages; `reasoning` input items (an earlier answer's thinking sent back) are taken and not
rendered. With the server's store on (`server.responses_store`, cluster/response_store.py),
`store: true` keeps the response with its input items (`input_items`, listed by `item_page`),
`background: true` (stored) answers at once and runs on in the ingress (cluster/ingress.py), and
`previous_response_id` runs the request after a stored response's conversation. What it cannot honour is refused with a 400 naming the field: other tool
types, `store: true` and `previous_response_id` with the store off, other `include`s,
`truncation: "auto"`, image / file / audio parts, other input items, and any unknown field.

Its answer is a `response` object (`response_body`) whose output is, on a server with a reasoning
parser, the thinking block's `reasoning` item (cluster/reasoning.py), the assistant's message and
then one `function_call` item per tool call, or, streamed, OpenAI's typed server-sent events
(`sse_events`): response.created, response.in_progress; for the reasoning
response.output_item.added and one response.reasoning_text.delta per piece; for the message
response.output_item.added, response.content_part.added, one response.output_text.delta per text
delta; for each call response.output_item.added and its response.function_call_arguments.delta
fragments; then each item's .done events, and response.completed, or response.incomplete when
max_output_tokens (or the context) ended it, or response.failed when the worker failed mid-stream.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import uuid
from typing import Any

from kvmesh.cluster import tool_parser
from kvmesh.cluster.openai_protocol import ApiError

logger = logging.getLogger("kvmesh.cluster")

# Sampling fields of the chat API (vLLM's extensions included) passed through under their own names.
SAMPLING_EXTRAS = ("seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")
# vLLM's request fields of /v1/responses that the chat takes as they are
VLLM_EXTRAS = ("priority", "cache_salt", "structured_outputs", "include_reasoning", "chat_template_kwargs")
FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                    "stream", "store", "metadata", "user", "prompt_cache_key", "text", "tools", "tool_choice",
                    "parallel_tool_calls", "truncation", "previous_response_id", "reasoning", "include",
                    "top_logprobs", "background", *SAMPLING_EXTRAS, *VLLM_EXTRAS})
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = {"input_text", "output_text"}
MAX_METADATA_KEYS = 16  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
LOGPROBS = "message.output_text.logprobs"  # the one `include` there is to give


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def chat_body(body: Any, earlier: list | None = None, store: bool = False) -> dict:
    """The chat completion request a Responses request asks for; ApiError(400) naming the field
    of what it cannot honour. `earlier`: the conversation of its previous_response_id (run before
    its input), already looked up; `store`: whether the server keeps responses."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise _bad(name, f"not a field of /v1/responses here (known: {', '.join(sorted(FIELDS))})")
    if body.get("background") is not None:
        if not isinstance(body["background"], bool):
            raise _bad("background", "a boolean")
        if body["background"] and body.get("store") is not True:
            raise _bad("background", "a background response is read back from the store: send store: true too")
        if body["background"] and body.get("stream"):
            raise _bad("background", "a background response cannot be streamed here; read it back with "
                       "GET /v1/responses/{id}")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise _bad("store", "a boolean")
    if body.get("store") and not store:
        raise _bad("store", "responses are not stored on this server (server.responses_store is 0); "
                   "send store: false or leave it out")
    if body.get("previous_response_id") is not None and earlier is None:
        raise _bad("previous_response_id", "responses are not stored on this server "
                   "(server.responses_store is 0), so none can be continued; send the conversation in input")
    effort = _reasoning_effort(body.get("reasoning"))
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation", "only \"disabled\": an input longer than the context is refused")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise _bad("parallel_tool_calls", "a boolean")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise _bad("metadata", f"an object of at most {MAX_METADATA_KEYS} string values")
    if "model" not in body:
        raise _bad("model", "required")
    chat: dict = {"model": body["model"], "messages": _messages(body, earlier or [])[0]}
    if tools := (_tools(body["tools"]) if body.get("tools") is not None else []):
        chat["tools"] = tools
        if (choice := body.get("tool_choice")) is not None:
            chat["tool_choice"] = _tool_choice(choice)
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    elif body.get("tool_choice") not in (None, "auto", "none"):
        raise _bad("tool_choice", "needs tools")
    if (top := _logprobs(body, calls_possible=bool(tools) and body.get("tool_choice") != "none")) is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top
    if (limit := body.get("max_output_tokens")) is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise _bad("max_output_tokens", "an integer of at least 1")
        chat["max_completion_tokens"] = limit
    for name in ("temperature", "top_p", "user", "prompt_cache_key", *SAMPLING_EXTRAS, *VLLM_EXTRAS):
        if body.get(name) is not None:
            chat[name] = body[name]
    if effort is not None:
        chat["reasoning_effort"] = effort
    if (fmt := _response_format(body.get("text"))) is not None:
        chat["response_format"] = fmt
    if body.get("stream") is not None:
        if not isinstance(body["stream"], bool):
            raise _bad("stream", "a boolean")
        chat["stream"] = body["stream"]
    return chat


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = (None, "auto", "concise", "detailed")


def _reasoning_effort(reasoning: Any) -> str | None:
    """OpenAI's `reasoning` settings: `effort` goes to the chat as its reasoning_effort (a template
    variable, and enable_thinking false for "none", as vLLM renders it); a `summary` is taken, but
    no summary is written (a reasoning item's `summary` stays empty: its `content` is the thinking
    itself)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _bad("reasoning", "an object of effort and summary")
    for key in reasoning:
        if key not in ("effort", "summary", "generate_summary"):
            raise _bad(f"reasoning.{key}", "not a reasoning setting here (effort, summary)")
    if reasoning.get("effort") not in (None, *EFFORTS):
        raise _bad("reasoning.effort", f"one of {', '.join(EFFORTS)}")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in SUMMARIES:
            raise _bad(f"reasoning.{key}", "auto, concise or detailed")
    return reasoning.get("effort")


def _logprobs(body: dict, calls_possible: bool) -> int | None:
    """How many alternatives each output token's logprob comes with (None: no logprobs): `include`
    names message.output_text.logprobs, `top_logprobs` the alternatives."""
    include = body.get("include")
    if include is not None and not isinstance(include, list):
        raise _bad("include", f"a list (of {LOGPROBS!r})")
    for i, name in enumerate(include or []):
        if name != LOGPROBS:
            raise _bad(f"include.{i}", f"only {LOGPROBS!r} can be included; got {name!r}")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                            or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise _bad("top_logprobs", f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    if not include:
        if top:
            raise _bad("top_logprobs", f"logprobs come with include: [{LOGPROBS!r}]")
        return None
    if calls_possible:  # a call's text is not the message's: the logprobs would not line up
        raise _bad("include", "logprobs cannot be given with tools the model may call "
                   "(tool_choice none allows them)")
    return top or 0


def input_items(body: dict) -> list[dict]:
    """The request's input as items as OpenAI lists them: each with an id, a message's content as
    parts (a string input is one user message); run through chat_body already."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return [_listed(item) for item in items]


def _listed(item: dict) -> dict:
    kind = item.get("type", "message")
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
    out = {"id": f"{prefix}_{uuid.uuid4().hex}", **item, "type": kind}
    if kind == "message" and isinstance(item["content"], str):
        part = ({"type": "output_text", "text": item["content"], "annotations": []} if item["role"] == "assistant"
                else {"type": "input_text", "text": item["content"]})
        out["content"] = [part]
    if kind != "message" or item["role"] == "assistant":
        out.setdefault("status", "completed")  # a field these items must have when listed
    return out


MAX_PAGE = 100  # OpenAI's limit on a page of listed items


def item_page(items: list[dict], limit: str | None, order: str | None, after: str | None) -> dict:
    """OpenAI's list object of `items` (oldest first): `order` desc (the default) or asc, up to
    `limit` (20 by default, 1-100) after the item whose id is `after`; ApiError(400) naming a bad one."""
    try:
        size = 20 if limit is None else int(limit)
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_PAGE:
        raise _bad("limit", f"an integer from 1 to {MAX_PAGE}")
    if order not in (None, "asc", "desc"):
        raise _bad("order", "asc or desc")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise _bad("after", f"no input item {after!r} in this response")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:size]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > size}


def _messages(body: dict, earlier: list) -> tuple[list[dict], int]:
    """The chat messages of `instructions`, the earlier conversation and the input, and how many
    come before the input's (input.N is messages.N + that)."""
    messages = []
    if (instructions := body.get("instructions")) is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "a string")
        messages.append({"role": "system", "content": instructions})
    _add_items(messages, earlier, "previous_response_id")
    before = len(messages)
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise _bad("input", "an empty string")
        return messages + [{"role": "user", "content": items}], before
    if not isinstance(items, list) or not items:
        raise _bad("input", "a string or a non-empty list of messages")
    _add_items(messages, items, "input")
    return messages, before


def _add_items(messages: list[dict], items: list, name: str) -> None:
    for i, item in enumerate(items):
        where = f"{name}.{i}"
        if not isinstance(item, dict):
            raise _bad(where, "a message object")
        kind = item.get("type", "message")
        if kind == "function_call":  # a call the model made: an assistant message's tool call
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":  # its result: a tool message
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _string(item, "output", where)})
            continue
        if kind == "reasoning":  # an earlier answer's thinking, sent back: not rendered (the
            continue             # reasoning templates drop earlier turns' thinking)
        if kind != "message":
            raise _bad(f"{where}.type", f"{kind!r} items are not supported; only message, function_call, "
                       "function_call_output and reasoning")
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"{where}.role", f"one of {', '.join(ROLES)}")
        messages.append({"role": ROLES[role], "content": _content(item.get("content"), where)})


def _string(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise _bad(f"{where}.{key}", "a string")
    return item[key]


def _tools(tools: Any) -> list[dict]:
    """Responses' function tools ({"type": "function", "name", ...}) as the chat's."""
    if not isinstance(tools, list):
        raise _bad("tools", "a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools.{i}.type", f"only function tools; got {kind!r}")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad(f"tools.{i}.name", "a function needs a name")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                           "strict") if k in tool}})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", "auto, none, required or {\"type\": \"function\", \"name\": ...}")


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _bad(f"{where}.content", "a string or a non-empty list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _bad(f"{where}.content.{j}.type", f"only text parts ({', '.join(sorted(TEXT_PARTS))}); "
                       f"got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.content.{j}.text", "a string")
        texts.append(part["text"])
    return "".join(texts)


def _response_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise _bad("text", "an object with a format")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict) or not isinstance(fmt.get("name"), str):
            raise _bad("text.format", "json_schema needs a name and a schema object")
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad("text.format.type", f"one of text, json_object, json_schema; got {kind!r}")


class ResponseShaper:
    """The response object of one request, in progress or done, for its body and its events."""

    def __init__(self, body: dict, model: str, created_at: int, earlier: list | None = None):
        self.id = f"resp_{uuid.uuid4().hex}"  # OpenAI's form of these ids: an underscore
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.body = body
        self.model = model
        self.created_at = created_at
        self.earlier = earlier or []  # the conversation of its previous_response_id
        self.stored = isinstance(body, dict) and body.get("store") is True
        self.background = isinstance(body, dict) and body.get("background") is True

    @functools.cached_property
    def inputs(self) -> list[dict]:
        """What it is stored with: the conversation it continued and its input items (their ids
        made once)."""
        return [*self.earlier, *input_items(self.body)]

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: str | None = None, error: dict | None = None) -> dict:
        body = self.body
        text = body.get("text") or {"format": {"type": "text"}}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": self.background,
                "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "model": self.model, "output": output,
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": body.get("previous_response_id"),
                "reasoning": _reasoning_echo(body.get("reasoning")),
                "store": self.stored, "temperature": body.get("temperature", 1.0),
                "top_logprobs": body.get("top_logprobs", 0),
                "text": text, "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
                "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
                "user": body.get("user"), "metadata": body.get("metadata") or {}}

    def reasoning(self, text: str | None, status: str) -> dict:
        """The reasoning item of a reasoning model's thinking block (server.reasoning_parser)."""
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content,
                "encrypted_content": None, "status": status}

    def message(self, text: str | None, status: str, logprobs: list | None = None) -> dict:
        content = [] if text is None else [self.part(text, logprobs)]
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def part(text: str, logprobs: list | None = None) -> dict:
        """An output_text part; `logprobs`: the chat's entries of its tokens (token, logprob, bytes,
        top_logprobs), which are the Responses API's too."""
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _reasoning_echo(reasoning: dict | None) -> dict | None:
    """The response's `reasoning`: the request's settings (checked by chat_body)."""
    if not isinstance(reasoning, dict):
        return None
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    # cache_write_tokens (tokens newly written to a prompt cache, a field the client requires) is not
    # counted here: 0
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def _ending(finish_reason: str | None) -> tuple[str, str | None]:
    """(the response's status, the reason it is incomplete) for the chat's finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def function_call(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call_id.rsplit('-', 1)[-1]}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def response_body(shaper: ResponseShaper, chat: dict) -> dict:
    """The response object of a finished chat completion body (one choice; its tool calls parsed)."""
    choice = chat["choices"][0]
    status, incomplete = _ending(choice.get("finish_reason"))
    message = choice["message"]
    calls = message.get("tool_calls") or []
    logprobs = (choice.get("logprobs") or {}).get("content")
    output = [shaper.reasoning(message["reasoning"], status)] if message.get("reasoning") is not None else []
    output += ([shaper.message(message.get("content") or "", status, logprobs)]
               if message.get("content") or not calls else [])
    output += [function_call(c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
               for c in calls]
    u = chat["usage"]
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return shaper.response(status, output, usage(u["prompt_tokens"], u["completion_tokens"], cached), incomplete)


def _event(kind: str, sequence: int, **data) -> bytes:
    payload = json.dumps({"type": kind, "sequence_number": sequence, **data}, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n".encode()


async def sse_events(stream, shaper: ResponseShaper, tools=None, logprobs_of=None, keep=None,
                     reasoning=None):
    """The typed events of a streamed response over an admitted request's DeltaStream; with
    `tools` (a ToolRequest) the text is read into content and tool calls as the chat's stream reads
    it (tool_parser.ToolStream); with `reasoning` (cluster.reasoning.ChatReasoning) the thinking
    block goes first, as a reasoning item and its response.reasoning_text.delta events. `logprobs_of(delta)`: the logprob entries of a delta's tokens
    (None: none asked for). `keep(response)`: awaited with the finished response before its last
    event (the store); if it raises, the last event is response.failed. Closing it closes the
    stream (SseResponse does so however the response ends)."""
    sequence = 0
    items: list[dict] = []  # the output items in order; the message is created at its first text
    message: dict | None = None
    calls: dict[int, dict] = {}  # a tool call's index -> its function_call item
    # logprobs of tokens whose text has not come yet (a character cut between tokens): they go
    # out with the next text delta
    held: list[dict] = []

    def event(kind: str, **data) -> bytes:
        nonlocal sequence
        sequence += 1
        return _event(kind, sequence - 1, **data)

    def text_of(item: dict) -> str:
        return "".join(item["_text"])

    def open_message() -> list[bytes]:
        nonlocal message
        message = {"_text": [], "_logprobs": [], "index": len(items)}
        items.append(message)
        return [event("response.output_item.added", output_index=message["index"],
                      item=shaper.message(None, "in_progress")),
                event("response.content_part.added", item_id=shaper.message_id, output_index=message["index"],
                      content_index=0, part=shaper.part(""))]

    thought: dict | None = None  # the reasoning item, created at its first text

    def reasoning_events(text: str) -> list[bytes]:
        nonlocal thought, held
        out = []
        if thought is None:
            thought = {"_text": [], "index": len(items)}
            items.append(thought)
            out.append(event("response.output_item.added", output_index=thought["index"],
                              item=shaper.reasoning(None, "in_progress")))
        thought["_text"].append(text)
        held = []  # the thinking's tokens: their logprobs are not output_text's
        out.append(event("response.reasoning_text.delta", item_id=shaper.reasoning_id,
                         output_index=thought["index"], content_index=0, delta=text))
        return out

    def pieces_events(pieces: list[dict], logprobs: list) -> list[bytes]:
        nonlocal held
        held = held + logprobs
        out = []
        for piece in pieces:
            if piece.get("reasoning"):
                out += reasoning_events(piece["reasoning"])
            if piece.get("content"):
                if message is None:
                    out += open_message()
                message["_text"].append(piece["content"])
                message["_logprobs"] += held  # without tools: one piece, the delta's text
                out.append(event("response.output_text.delta", item_id=shaper.message_id,
                                 output_index=message["index"], content_index=0, delta=piece["content"],
                                 logprobs=held))
                held = []
            for part in piece.get("tool_calls") or []:
                fn = part.get("function") or {}
                entry = calls.get(part["index"])
                if entry is None:  # its first delta: id and name
                    entry = {"call": function_call(part["id"], fn["name"], "", "in_progress"), "_text": [],
                             "index": len(items)}
                    calls[part["index"]] = entry
                    items.append(entry)
                    out.append(event("response.output_item.added", output_index=entry["index"],
                                     item=entry["call"]))
                if fn.get("arguments"):
                    entry["_text"].append(fn["arguments"])
                    out.append(event("response.function_call_arguments.delta", item_id=entry["call"]["id"],
                                     output_index=entry["index"], delta=fn["arguments"]))
        return out

    parser = tool_parser.ToolStream(tools) if tools is not None else None
    async with stream:
        yield event("response.created", response=shaper.response("in_progress", []))
        yield event("response.in_progress", response=shaper.response("in_progress", []))
        if parser is None and reasoning is None:
            for chunk in open_message():
                yield chunk
        last = None
        async for delta in stream:
            last = delta
            pieces, text = (reasoning.pieces(delta.index, delta.text, delta.finish_reason is not None)
                            if reasoning is not None else ([], delta.text))
            pieces += parser.feed(text) if parser is not None else [{"content": text}]
            if parser is not None and delta.finish_reason is not None:
                pieces += parser.finish()
            logprobs = logprobs_of(delta) if logprobs_of is not None else []
            for chunk in pieces_events(pieces, logprobs):
                yield chunk
        if held and message is not None:  # tokens whose text never completed
            message["_logprobs"] += held
        if last is None or last.finish_reason in ("error", "abort"):
            error = (last.error if last is not None else None) or "the worker ended the request"
            done = ([shaper.message(text_of(message), "incomplete", message["_logprobs"])]
                    if message is not None else [])
            failed = shaper.response("failed", done, error={"code": "server_error", "message": error})
            if keep is not None:
                try:
                    await keep(failed)
                except Exception:  # the failure is what the client hears of
                    logger.warning("kvmesh: could not store failed response %s", shaper.id, exc_info=True)
            yield event("response.failed", response=failed)
            return
        if message is None and not calls:  # no text and no call: an empty message
            for chunk in open_message():
                yield chunk
            message["_logprobs"] += held
        status, incomplete = _ending(last.finish_reason)
        output = []
        for item in items:
            if item is thought:
                text = text_of(thought)
                yield event("response.reasoning_text.done", item_id=shaper.reasoning_id,
                            output_index=thought["index"], content_index=0, text=text)
                output.append(shaper.reasoning(text, status))
            elif item is message:
                text = text_of(message)
                where = {"item_id": shaper.message_id, "output_index": message["index"], "content_index": 0}
                logprobs = message["_logprobs"]
                yield event("response.output_text.done", **where, text=text, logprobs=logprobs)
                yield event("response.content_part.done", **where, part=shaper.part(text, logprobs))
                output.append(shaper.message(text, status, logprobs))
            else:
                call = dict(item["call"], arguments=text_of(item), status="completed")
                yield event("response.function_call_arguments.done", item_id=call["id"],
                            output_index=item["index"], name=call["name"], arguments=call["arguments"])
                output.append(call)
            yield event("response.output_item.done", output_index=item["index"], item=output[-1])
        done = usage(last.num_prompt_tokens or stream.routed.num_prompt_tokens, stream.num_tokens,
                     last.num_cached_tokens)
        final = shaper.response(status, output, done, incomplete)
        if keep is not None:
            try:
                await keep(final)
            except Exception as e:
                logger.warning("kvmesh: could not store response %s", shaper.id, exc_info=True)
                yield event("response.failed", response=shaper.response(
                    "failed", output, done, error={"code": "server_error",
                                                   "message": f"the response could not be stored: {e!r}"}))
                return
        yield event("response.completed" if status == "completed" else "response.incomplete",
                    response=final)


def in_responses_terms(error: ApiError, body: dict, earlier: list | None = None) -> ApiError:
    """An error the chat path raised, naming the Responses request's fields instead of the chat's:
    max_completion_tokens is max_output_tokens, response_format (and its json_schema) is text.format,
    messages.N is input.N (less the messages of instructions and of the `earlier` conversation
    before it), the prompt is the input, and a tool's tools.N.function.x is tools.N.x."""
    shift = 0
    if isinstance(body, dict):
        before: list[dict] = []
        _add_items(before, earlier or [], "previous_response_id")  # stored: valid
        shift = len(before) + (body.get("instructions") is not None)

    def rename(text: str | None) -> str | None:
        if text is None:
            return None
        text = (text.replace("max_completion_tokens", "max_output_tokens")
                .replace("response_format.json_schema", "text.format").replace("response_format", "text.format"))
        text = re.sub(r"messages\.(\d+)", lambda m: f"input.{max(0, int(m.group(1)) - shift)}", text)
        text = re.sub(r"tools\.(\d+)\.function", r"tools.\1", text)  # Responses' tools are flat
        return text.replace("messages", "input")

    return ApiError(error.status, rename(error.message), rename(error.param), error.type, error.code,
                    error.retry_after_s)
