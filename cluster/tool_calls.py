"""Tool calling, request side: `tools`, `tool_choice` and `parallel_tool_calls` read and checked, the
tools and the history's tool calls / tool results rendered into the prompt, and the structured
output that `tool_choice: required` or a named function enforces.

Rendering: a chat template that knows tools (its text mentions `tools`) gets them as
transformers' `apply_chat_template(tools=...)` passes them, and assistant `tool_calls` / `tool`
messages as Hugging Face's chat format has them. Other templates (the default SmolLM2's) get the
Hermes / Qwen2.5 form as plain message text: a system block listing the tools in `<tools>` and
asking for `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, each past call as such a block
in its assistant turn, each tool result as a user turn in `<tool_response>`. Everything a client
wrote stays message content, tokenized as text (worker/chat_template.py); with a tools template,
tool definitions and call arguments are template text, so special-token text in them is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.cluster.structured_request import Structured
from kvmesh.structured_outputs import StructuredOutputs, canonical_json

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ToolRequest:
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {...}}], checked
    choice: str  # "none" | "auto" | "required" | "function"
    function_name: str | None = None  # with choice "function"
    parallel: bool = True
    names: list[str] = field(default_factory=list)

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"


def parse_tools(req) -> ToolRequest | None:
    """The request's tools and tool_choice (None: no tools), or ApiError(400) naming the field."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ApiError(400, "tools: each tool must be {\"type\": \"function\", \"function\": "
                           "{...}}", param=f"tools.{i}.type")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, "tools: each function needs a name", param=f"tools.{i}.function")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, "a function's parameters must be a JSON schema object",
                           param=f"tools.{i}.function.parameters")
        names.append(fn["name"])
    parallel = getattr(req, "parallel_tool_calls", None)
    request = ToolRequest(list(tools), "auto", parallel=parallel is not False, names=names)
    if choice is None or choice in ("auto", "none", "required"):
        request.choice = choice or "auto"
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if name not in names:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not in tools",
                           param="tool_choice")
        request.choice, request.function_name = "function", name
    else:
        raise ApiError(400, "tool_choice must be none, auto, required or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    return request


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def forced_structure(request: ToolRequest) -> Structured | None:
    """What `required` / a named function constrains the output to (as vLLM): the named function's
    arguments object; or a JSON array of one or more {"name", "parameters"} calls."""
    if request.choice == "function":
        tool = request.tools[request.names.index(request.function_name)]
        return Structured(StructuredOutputs(json=canonical_json(_parameters(tool))), "tool_choice")
    if request.choice == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": _parameters(t)},
                  "required": ["name", "parameters"]} for t in request.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not request.parallel:
            schema["maxItems"] = 1
        return Structured(StructuredOutputs(json=canonical_json(schema)), "tool_choice")
    return None


# ---- the prompt ------------------------------------------------------------------------------

def template_supports_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render_chat(messages, texts: list[dict], request: ToolRequest | None,
                tokenizer) -> tuple[list[dict], list[dict] | None]:
    """(messages for the chat template, tools for it or None). `messages` are the request's
    ChatMessages; `texts` are the same as chat_prompt_text gives them (content joined as text)."""
    native = template_supports_tools(tokenizer)
    out = []
    for i, (m, text) in enumerate(zip(messages, texts)):
        calls = getattr(m, "tool_calls", None)
        if m.role == "assistant" and calls:
            parsed = [_history_call(call, f"messages.{i}.tool_calls.{j}") for j, call in enumerate(calls)]
            if native:
                out.append({"role": "assistant", "content": text["content"],
                            "tool_calls": [{"type": "function", "id": c["id"],
                                            "function": {"name": c["name"], "arguments": c["arguments"]}}
                                           for c in parsed]})
            else:
                blocks = "\n".join("<tool_call>\n" + json.dumps(
                    {"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
                    + "\n</tool_call>" for c in parsed)
                content = text["content"]
                out.append({"role": "assistant", "content": (content + "\n" if content else "") + blocks})
        elif m.role == "tool":
            if native:
                out.append({"role": "tool", "content": text["content"],
                            "tool_call_id": getattr(m, "tool_call_id", None)})
            else:
                out.append({"role": "user", "content": "<tool_response>\n" + text["content"]
                            + "\n</tool_response>"})
        else:
            name = getattr(m, "name", None)
            if name is not None:  # the template's own text if it renders it: no control tokens
                refuse_special_text(tokenizer, name, f"messages.{i}.name")
                text = {**text, "name": name}
            out.append(text)
    if native:  # what the template renders as its own text besides the content
        refuse_special_text(tokenizer, [[m.get("tool_calls"), m.get("tool_call_id")] for m in out],
                             "messages")
        if request is not None:
            refuse_special_text(tokenizer, request.tools, "tools")
    if request is None:
        return out, None
    if native:
        return out, request.tools
    block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                  for t in request.tools))
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def _history_call(call, param: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, "a tool call needs function.name", param=param)
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ApiError(400, "a tool call's function.arguments must be JSON text",
                           param=f"{param}.function.arguments") from None
    return {"id": call.get("id"), "name": fn["name"], "arguments": arguments}


def refuse_special_text(tokenizer, value, param: str) -> None:
    """Text the template renders as its own (not message content) must hold no control token."""
    text = json.dumps(value, ensure_ascii=False)
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    for token in sorted(specials | set(tokenizer.all_special_tokens)):
        if token and token in text:
            raise ApiError(400, f"{param}: holds the special token text {token!r}", param=param)
