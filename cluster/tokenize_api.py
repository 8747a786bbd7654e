"""vLLM's /tokenize and /detokenize request and response shapes.

/tokenize takes a `prompt` (tokenized as /v1/completions tokenizes it) or chat `messages` (as
/v1/chat/completions does, with its add_generation_prompt, continue_final_message,
chat_template_kwargs, add_special_tokens, chat_template and documents), so `count` is the `prompt_tokens` those endpoints report for the same input. Unknown fields and values kvmesh does not implement are a 400
naming them, as on the completions endpoints.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmesh.cluster.openai_protocol import ApiError, ChatMessage, _field_path

MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions (and vLLM's /tokenize)
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # these three as on chat (openai_request.template_options)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # as on chat (and vLLM's /tokenize with messages)
    chat_template: str | None = None  # as on chat (bounded there: openai_request.template_options)
    documents: list[dict[str, str]] | None = None
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)


def parse(body: Any, cls: type[BaseModel]) -> BaseModel:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if cls is TokenizeCompletion and "messages" in body:
        cls = TokenizeChat
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = max(e.errors(), key=lambda err: len(err["loc"]))
        param = _field_path(body, err["loc"])
        message = (f"unknown field {param!r}" if err["type"] == "extra_forbidden"
                   else f"{param}: {err['msg']}")
        raise ApiError(400, message, param=param) from None
    return req


def tokenize_response(token_ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict:
    return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids,
            "token_strs": token_strs}
