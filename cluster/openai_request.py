"""An OpenAI request's prompts and sampling parameters, as the ingress's routes hand them to the
request pipeline (pipeline.py): chat messages rendered with their tools, completions' prompts as
text or token ids (one choice each), the structured-outputs spec in the sampling parameters."""

import dataclasses

from kvmesh.cluster.openai_protocol import ApiError, chat_prompt_text, sampling_params
from kvmesh.cluster.pipeline import Prompt
from kvmesh.cluster.tool_calls import render_chat


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
        return [Prompt("messages", messages=messages, tools=template_tools)]
    prompt = req.prompt
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        return [one_prompt(prompt, "prompt")]
    if len(prompt) > MAX_PROMPTS_PER_REQUEST:
        raise ApiError(400, f"prompt: {len(prompt)} prompts in one request; the limit is "
                       f"{MAX_PROMPTS_PER_REQUEST}", param="prompt")
    if len(prompt) == 1:
        return [one_prompt(prompt[0], "prompt")]
    return [one_prompt(p, f"prompt.{i}") for i, p in enumerate(prompt)]


def one_prompt(prompt, param: str) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(param, text=prompt)
    return Prompt(param, token_ids=list(prompt))


def sampling_params_with(req, structured, remaining_context: int):
    params = sampling_params(req, remaining_context)
    if structured is not None:
        params = dataclasses.replace(params, structured_outputs=structured.spec)
    return params
