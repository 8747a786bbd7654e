"""What a kvmesh.v1 GenerateRequest asks beyond sampling, read once before admission, and how its
responses carry it: structured outputs (built once, then compiled and passed on), tools and
tool_choice (rendered into the chat as HTTP renders them, calls streamed as tool-call deltas),
echo and prompt logprobs (on the first messages). The same code as HTTP's does the work
(structured_request, tool_calls, tool_parser, openai_echo's rules); this is the gRPC shape of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

from kvmesh.cluster import tool_parser
from kvmesh.cluster.reasoning import ChatReasoning, ReasoningParser
from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.cluster.structured_request import Structured
from kvmesh.cluster.tool_calls import ToolRequest, forced_structure, parse_tools, render_chat
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.protocol import PromptLogprobs, TokenDelta
from kvmesh.structured_outputs import StructuredOutputs


@dataclass
class GrpcAsk:
    """A GenerateRequest's constraint (built once: compiled, then handed to the sampling params)
    and its tools (None: no tools)."""
    structured: Structured | None = None
    tools: ToolRequest | None = None


def read_ask(request: pb.GenerateRequest) -> GrpcAsk:
    check_template_fields(request)
    ask = GrpcAsk()
    if request.HasField("structured_outputs"):
        ask.structured = Structured(structured_from_proto(request.structured_outputs),
                                    "structured_outputs")
    if request.tools or request.tool_choice:
        ask.tools = _tools(request)
    tools = ask.tools
    if tools is not None and tools.parses_output:
        if not request.messages:
            raise ApiError(400, "tools need messages (the chat template renders them)",
                           param="tools")
        if request.HasField("logprobs"):
            raise ApiError(400, "logprobs cannot be streamed with tools (tool-call deltas are not "
                           "token-aligned)", param="logprobs")
    if tools is not None and (forced := forced_structure(tools)) is not None:
        if ask.structured is not None:
            raise ApiError(400, f"tool_choice {tools.choice} constrains the output; "
                           "structured_outputs cannot be given with it", param="structured_outputs")
        ask.structured = Structured(forced.spec, "tool_choice")
    return ask


def structured_from_proto(spec: pb.StructuredOutputs) -> StructuredOutputs:
    """The request's constraint as kvmesh's plain data; ApiError(400) naming the field when it
    is not exactly one well-formed constraint."""
    param = "structured_outputs"
    schema = None
    if spec.HasField("json_schema"):
        param = "structured_outputs.json_schema"
        try:
            schema = json.loads(spec.json_schema)
        except ValueError as e:
            raise ApiError(400, f"{param}: not JSON ({e})", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, f"{param}: a JSON schema is an object", param=param)
    try:
        return StructuredOutputs(
            json=schema, json_object=spec.json_object,
            regex=spec.regex if spec.HasField("regex") else None,
            choice=list(spec.choice) or None,
            grammar=spec.grammar if spec.HasField("grammar") else None)
    except ValueError as e:
        raise ApiError(400, str(e), param=param) from None


def _tools(request: pb.GenerateRequest) -> ToolRequest | None:
    """tools / tool_choice in OpenAI's shape, checked by the same code as HTTP's."""
    tools = []
    for i, tool in enumerate(request.tools):
        function = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                function["parameters"] = json.loads(tool.parameters)
            except ValueError as e:
                raise ApiError(400, f"tools.{i}.parameters: not JSON ({e})",
                               param=f"tools.{i}.parameters") from None
        tools.append({"type": "function", "function": function})
    choice = request.tool_choice or None
    if choice not in (None, "none", "auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
    return parse_tools(SimpleNamespace(tools=tools, tool_choice=choice, parallel_tool_calls=parallel))


def chat_messages(request: pb.GenerateRequest, tools: ToolRequest | None,
                  tokenizer) -> tuple[list[dict], list[dict] | None]:
    """(messages for the chat template, tools for it or None), history calls and tool results
    rendered as HTTP renders them (tool_calls.render_chat)."""
    messages = [SimpleNamespace(
        role=m.role, tool_call_id=m.tool_call_id or None,
        tool_calls=[{"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments or "{}"}}
                    for c in m.tool_calls] or None)
        for m in request.messages]
    texts = [{"role": m.role, "content": m.content} for m in request.messages]
    return render_chat(messages, texts, tools, tokenizer)


TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                   "chat_template", "documents")
OPTIONAL_TEMPLATE_FIELDS = ("add_generation_prompt", "chat_template")  # given when set, even empty


def _json_text(request: pb.GenerateRequest, name: str):
    """A field that carries JSON as text (protobuf has no JSON value), parsed; None when empty."""
    text = getattr(request, name)
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ApiError(400, f"{name}: not JSON text ({e})", param=name) from None


def chat_template_options(request: pb.GenerateRequest, tokenizer, messages: list[dict]):
    """How the chat template is applied to `messages`, as HTTP's chat fields of the same names
    (openai_request.template_options); chat_template_kwargs and documents arrive as JSON text."""
    from kvmesh.cluster.openai_request import template_options

    kwargs = _json_text(request, "chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs: a JSON object", param="chat_template_kwargs")
    ask = SimpleNamespace(
        add_generation_prompt=request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
        continue_final_message=request.continue_final_message, chat_template_kwargs=kwargs,
        add_special_tokens=request.add_special_tokens,  # unset: false, as on chat
        chat_template=request.chat_template if request.HasField("chat_template") else None,
        documents=_json_text(request, "documents"))  # its limits: openai_request.template_options
    return template_options(ask, tokenizer, messages)


def check_template_fields(request: pb.GenerateRequest) -> None:
    """The chat template fields need messages (a prompt has no template)."""
    if not request.messages:
        given = [f for f in TEMPLATE_FIELDS if (request.HasField(f) if f in OPTIONAL_TEMPLATE_FIELDS
                                                 else getattr(request, f))]
        if given:
            raise ApiError(400, f"{given[0]}: only with messages (a prompt is sent as it is)", param=given[0])


def prompt_logprobs_asked(request: pb.GenerateRequest) -> int | None:
    """The engine's prompt_logprobs: the request's, and `logprobs` when the prompt is echoed."""
    asked = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
    if request.echo and request.HasField("logprobs"):
        asked = max(asked or 0, request.logprobs)
    return asked


def prompt_logprob_entries(scores: PromptLogprobs, top_k: int) -> list[pb.PromptTokenLogprob]:
    out = []
    for logprob, rank, top in zip(scores.logprobs, scores.ranks, scores.top):
        entry = pb.PromptTokenLogprob(top=dict(list((top or {}).items())[:top_k]))
        if logprob is not None:
            entry.logprob = logprob
        if rank is not None:
            entry.rank = rank
        out.append(entry)
    return out


class ResponseShape:
    """Puts what the request asked for into its stream's messages: the echoed prompt on the
    first, the prompt's logprobs on the first with a token, tool calls parsed from the text."""

    def __init__(self, request: pb.GenerateRequest, ask: GrpcAsk, prompt_ids: list[int],
                 decode, reasoning: ReasoningParser | None = None):
        """`reasoning`: the server's parser (server.reasoning_parser), which reads chat answers."""
        self.echo = request.echo
        self.reasoning = (ChatReasoning(reasoning, prompt_ids, not request.HasField("include_reasoning")
                                        or request.include_reasoning)
                          if reasoning is not None and request.messages else None)
        self.prompt_ids, self.decode = prompt_ids, decode
        self.prompt_text = request.prompt if request.prompt else None
        self.top_k = prompt_logprobs_asked(request)
        self.tools = ask.tools if ask.tools is not None and ask.tools.parses_output else None
        self.parsers: dict[int, tool_parser.ToolStream] = {}  # n > 1: one per sequence
        self._first = True

    def apply(self, out: pb.GenerateResponse, delta: TokenDelta) -> pb.GenerateResponse:
        if self._first and self.echo:
            out.prompt_text = (self.prompt_text if self.prompt_text is not None
                               else self.decode(self.prompt_ids))
            out.prompt_token_ids.extend(self.prompt_ids)
        self._first = False
        if delta.prompt_logprobs is not None and self.top_k is not None:
            out.prompt_logprobs.extend(prompt_logprob_entries(delta.prompt_logprobs, self.top_k))
        ended = delta.finish_reason is not None  # this sequence's end
        text = delta.text
        if self.reasoning is not None:
            out.reasoning, text = self.reasoning.piece(delta.index, text, ended)
            out.text = text
        if self.tools is None:
            return out
        parser = self.parsers.setdefault(delta.index, tool_parser.ToolStream(self.tools))
        pieces = parser.feed(text)
        if ended:
            pieces += parser.finish()
        out.text = "".join(p.get("content", "") for p in pieces)
        for piece in pieces:
            for call in piece.get("tool_calls", []):
                function = call.get("function", {})
                out.tool_calls.append(pb.ToolCallDelta(
                    index=call["index"], id=call.get("id", ""), name=function.get("name", ""),
                    arguments=function.get("arguments", "")))
        if ended:
            out.finish_reason = tool_parser.finish_reason(delta.finish_reason, self.tools,
                                                          parser.calls) or ""
        return out
