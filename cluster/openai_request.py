"""An OpenAI request's prompts and sampling parameters, as the ingress's routes hand them to the
request pipeline (pipeline.py): chat messages rendered with their tools, completions' prompts as
text or token ids (one choice each), the structured-outputs spec in the sampling parameters."""

import dataclasses

from kvmesh.cluster.openai_protocol import (MAX_CHAT_TEMPLATE_CHARS, MAX_DOCUMENTS, ApiError, chat_prompt_text,
                                            sampling_params)
from kvmesh.cluster.pipeline import Prompt
from kvmesh.cluster.tool_calls import refuse_special_text, render_chat
from kvmesh.worker.chat_template import TemplateOptions


def template_options(req, tokenizer, messages: list[dict]) -> TemplateOptions:
    """How a chat request (or /tokenize's) applies the chat template: add_generation_prompt,
    continue_final_message, chat_template_kwargs, add_special_tokens, chat_template, documents,
    and OpenAI's reasoning_effort as vLLM renders it (the template variable, and enable_thinking
    false for "none" unless chat_template_kwargs says otherwise); ApiError(400) naming the field of
    a bad one.
    A kwarg's value is the template's own text once rendered: it may hold no control token."""
    kwargs = getattr(req, "chat_template_kwargs", None) or {}
    if (effort := getattr(req, "reasoning_effort", None)) is not None:  # vLLM's mapping
        kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none", **kwargs}
    template, documents = getattr(req, "chat_template", None), getattr(req, "documents", None)
    if template is not None and len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise ApiError(400, f"chat_template: at most {MAX_CHAT_TEMPLATE_CHARS} characters, got {len(template)}",
                       param="chat_template")
    if documents is not None and not (isinstance(documents, list) and len(documents) <= MAX_DOCUMENTS and all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents)):
        raise ApiError(400, f"documents: a list of at most {MAX_DOCUMENTS} objects of strings",
                       param="documents")
    try:
        options = TemplateOptions(req.add_generation_prompt, req.continue_final_message, dict(kwargs),
                                  req.add_special_tokens, template, documents)
    except ValueError as e:
        param = str(e).split(":", 1)[0]
        raise ApiError(400, str(e), param=param) from None
    for key, value in kwargs.items():
        refuse_special_text(tokenizer, value, f"chat_template_kwargs.{key}")
    if options.continue_final_message and not isinstance(messages[-1].get("content"), str):
        raise ApiError(400, "continue_final_message: the final message has no text content to continue",
                       param="continue_final_message")
    return options


def check_chat_template(req, trusted: bool) -> None:
    """A request's own chat_template only where server.trust_request_chat_template allows it."""
    if getattr(req, "chat_template", None) is not None and not trusted:
        raise ApiError(400, "chat_template: this server does not run a request's own chat template "
                       "(server.trust_request_chat_template is false)", param="chat_template")


def response_role(req) -> str:
    """The answer's role (vLLM's): the assistant's, or without the generation prompt the final
    message's (the model continues that turn)."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def chat_echo_text(req) -> str:
    """What chat's `echo` puts before the answer: the final message's content when its role is
    the answer's (vLLM's), else nothing."""
    last = req.messages[-1]
    if last.role != response_role(req):
        return ""
    return chat_prompt_text([last])[0].get("content") or ""


def session_key(request, header: str, req) -> str | None:
    """The session routing policy's key: the session header, else OpenAI's `prompt_cache_key`,
    else `user` (None: the policy keys on the prompt's first block)."""
    return request.headers.get(header) or req.prompt_cache_key or req.user


def max_tokens_param(req) -> str:
    return ("max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None
            else "max_tokens")


# Prompts in one completions request (each is a choice, answered with its index, as vLLM).
MAX_PROMPTS_PER_REQUEST = 64


def prompts_of(req, kind: str, tools=None, tokenizer=None) -> list[Prompt]:
    """The request's prompts: one for chat (its tools rendered: cluster/tool_calls.py); for
    completions a string, a list of token ids, or a list of either (one choice each)."""
    if kind == "chat":
        messages, template_tools = render_chat(req.messages, chat_prompt_text(req.messages), tools,
                                               tokenizer)
        return [Prompt("messages", messages=messages, tools=template_tools,
                       template=template_options(req, tokenizer, messages), truncate=truncation(req))]
    prompt, truncate, special = req.prompt, truncation(req), req.add_special_tokens
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        return [one_prompt(prompt, "prompt", truncate, special)]
    if len(prompt) > MAX_PROMPTS_PER_REQUEST:
        raise ApiError(400, f"prompt: {len(prompt)} prompts in one request; the limit is "
                       f"{MAX_PROMPTS_PER_REQUEST}", param="prompt")
    if len(prompt) == 1:
        return [one_prompt(prompt[0], "prompt", truncate, special)]
    return [one_prompt(p, f"prompt.{i}", truncate, special) for i, p in enumerate(prompt)]


def truncation(req) -> int | None:
    return checked_truncation(req.truncate_prompt_tokens)


def checked_truncation(k: int | None) -> int | None:
    """truncate_prompt_tokens (vLLM's; HTTP and gRPC): None, -1, or k >= 1 last tokens kept."""
    if k is not None and k != -1 and k < 1:
        raise ApiError(400, "truncate_prompt_tokens: -1 (as many as the server takes) or at least 1",
                       param="truncate_prompt_tokens")
    return k


def one_prompt(prompt, param: str, truncate: int | None = None, add_special_tokens: bool = True) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(param, text=prompt, truncate=truncate, add_special_tokens=add_special_tokens)
    return Prompt(param, token_ids=list(prompt), truncate=truncate)


def sampling_params_with(req, structured, remaining_context: int):
    params = sampling_params(req, remaining_context)
    if structured is not None:
        params = dataclasses.replace(params, structured_outputs=structured.spec)
    return params
