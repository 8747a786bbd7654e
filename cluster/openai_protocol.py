"""OpenAI-compatible request parsing and response shapes (chat completions and completions).

Requests are validated here, before anything reaches a worker: a bad field raises ApiError(400)
naming it (`param`), the OpenAI error JSON is built by `error_body`. Fields OpenAI or vLLM define
but kvmesh does not implement (tools, ...) are rejected by name rather than ignored, and so are
unknown fields (api_fields.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmesh.cluster.api_fields import CHAT, COMPLETION, STREAM_OPTIONS, check_fields
from kvmesh.sampling_params import SamplingParams


MAX_CHAT_TEMPLATE_CHARS = 65536  # a request's own chat_template
MAX_DOCUMENTS = 256  # a chat's documents (their text counts toward the prompt's limits once rendered)


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.retry_after_s = type, code, retry_after_s

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    # Keys that are not fields here are checked by api_fields.check_fields before validation:
    # OpenAI's and vLLM's unimplemented fields and unknown keys are refused by name. Strict: a
    # number is a JSON number, never "10" or true (an integer is still a valid float).
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    # OpenAI's routing hint for cached prompts: the session key of the `session` routing policy,
    # before `user` (the session header comes first)
    prompt_cache_key: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    # vLLM's sampling fields (kvmesh.SamplingParams says what each does)
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    # Structured outputs (cluster/structured_request.py reads them; at most one per request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM's output options (cluster/openai_responses.py Shaper): the prompt's and each choice's
    # token ids beside the text; logprob tokens as "token_id:N"
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: only the prompt's last k tokens (-1: as many as the server takes); pipeline.Prompt
    truncate_prompt_tokens: int | None = None
    # vLLM's: the prompt's cached blocks are shared only with requests of the same salt
    # (multi-tenant isolation: another tenant cannot time a cache hit on your prompt)
    cache_salt: str | None = None
    # vLLM's: lower runs first in a worker's queue under engine.scheduling_policy "priority"
    # (RequestPipeline refuses anything but 0 under "fcfs")
    priority: int = Field(0, ge=-2**63, lt=2**63)


class ChatMessage(BaseModel):
    # A key OpenAI's message types do not define is refused by its path (messages.0.x), as
    # top-level fields are; nothing in a message is dropped unseen.
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: calls made (cluster/tool_calls.py)
    tool_call_id: str | None = None  # tool: the call this message answers
    name: str | None = None  # passed to the chat template, as vLLM does (tool_calls.render_chat)
    # An assistant message sent back as another server returned it: only their empty values.
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's (cluster/openai_echo.py)
    tools: list[dict[str, Any]] | None = None  # cluster/tool_calls.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template fields (cluster/openai_request.py template_options)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the final message's content leads the answer when its role is the answer's
    # vLLM's: the tokenizer's special tokens (e.g. BOS) around the rendered template; off, as
    # vLLM's chat (the template writes its own)
    add_special_tokens: bool = False
    # vLLM's: the request's own Jinja template (only with server.trust_request_chat_template) and
    # the documents a RAG template renders
    # (their limits, MAX_CHAT_TEMPLATE_CHARS and MAX_DOCUMENTS: openai_request.template_options,
    # which gRPC's fields go through too)
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    # vLLM's: with server.reasoning_parser, false leaves the thinking block's text out of the
    # answer (its `reasoning` field is null; the content is the same)
    include_reasoning: bool = True
    # OpenAI's, as vLLM takes it: a chat template variable `reasoning_effort`, and
    # `enable_thinking` (false for "none") unless chat_template_kwargs sets it
    # (openai_request.template_options)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False  # the prompt leads the text (and its logprobs): cluster/openai_echo.py
    prompt_logprobs: int | None = None  # vLLM's
    best_of: int | None = None  # cluster/openai_choices.py
    # vLLM's: a text prompt tokenized with the tokenizer's special tokens (e.g. Llama's BOS), as
    # vLLM's completions (on by default); token-id prompts are taken as they are
    add_special_tokens: bool = True


def parse_request(body: Any, cls: type[_Request]) -> _Request:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, CHAT if cls is ChatCompletionRequest else COMPLETION, cls.model_fields)
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        # A union reports one error per branch: the one that got deepest says the most.
        err = max(e.errors(), key=lambda err: len(err["loc"]))
        param = _field_path(body, err["loc"])
        raise ApiError(400, f"{param}: {err['msg']}", param=param) from None
    check_choices(body, req)
    _check_stream_options(req)
    return req


def check_choices(body: dict, req: _Request) -> None:
    """n and best_of (cluster/openai_choices.py): best_of is a completions field, and picking the
    best of several sequences needs them whole, so not with stream (as OpenAI and vLLM)."""
    if isinstance(req, ChatCompletionRequest) and body.get("best_of") is not None:
        raise ApiError(400, "best_of is a field of /v1/completions, not of chat completions",
                       param="best_of")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and req.stream and best_of != req.n:
        raise ApiError(400, "best_of cannot be used with stream: the best sequences are known only "
                       "when all have finished", param="best_of")


def _check_stream_options(req: _Request) -> None:
    options = req.stream_options
    if options is None:
        return
    if not req.stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options")
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise ApiError(400, f"stream_options.{key} is not a stream option (known: "
                           f"{', '.join(STREAM_OPTIONS)})", param=f"stream_options.{key}")
        if not isinstance(value, bool):
            raise ApiError(400, f"stream_options.{key} must be a boolean",
                           param=f"stream_options.{key}")
    if options.get("continuous_usage_stats") and not options.get("include_usage"):
        raise ApiError(400, "stream_options.continuous_usage_stats needs include_usage: true "
                       "(as vLLM)", param="stream_options.continuous_usage_stats")


def _field_path(body: Any, loc: tuple) -> str | None:
    """The request field an error is about: pydantic's location without the union branch names
    it adds (prompt.str -> prompt, messages.0.content.list[...].0 -> messages.0.content.0)."""
    path, node = [], body
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, (dict, list)) and not path and isinstance(part, str):
            path.append(part)  # a missing top-level field
            break
        else:
            continue  # a union branch or type name, not a place in the body
        path.append(str(part))
    return ".".join(path) or None


def chat_prompt_text(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them; content parts of type text are joined."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, "only text content parts are supported",
                                   param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out


def sampling_params(req: _Request, remaining_context: int) -> SamplingParams:
    """The request's SamplingParams; a bad value raises ApiError naming the OpenAI field."""
    max_tokens = req.max_tokens
    param_for_max = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, param_for_max = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = max(1, remaining_context)
    elif max_tokens > remaining_context:
        raise ApiError(400, f"{param_for_max} is {max_tokens} but only {remaining_context} tokens "
                       "of context are left after the prompt", param=param_for_max)
    logprobs = None
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.logprobs:
            logprobs = req.top_logprobs or 0
    else:
        logprobs = req.logprobs
    kwargs = dict(max_tokens=max_tokens, seed=req.seed, stop=req.stop or [], logprobs=logprobs,
                  ignore_eos=req.ignore_eos, prompt_logprobs=prompt_logprobs_asked(req),
                  n=req.n, best_of=getattr(req, "best_of", None), min_tokens=req.min_tokens,
                  stop_token_ids=req.stop_token_ids or [], logit_bias=_logit_bias(req.logit_bias),
                  allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or None,
                  include_stop_str_in_output=req.include_stop_str_in_output,
                  skip_special_tokens=req.skip_special_tokens)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        name = message.split(" ", 1)[0]
        if name == "max_tokens":
            name = param_for_max
        elif name == "logprobs" and isinstance(req, ChatCompletionRequest):
            name = "top_logprobs"
        raise ApiError(400, message, param=name) from None


def prompt_logprobs_asked(req: _Request) -> int | None:
    """How many alternatives per prompt token the engine scores: vLLM's prompt_logprobs, and
    `logprobs` of an echoed completion prompt (the larger)."""
    asked = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        asked = req.logprobs if asked is None else max(asked, req.logprobs)
    return asked
def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias is keyed by token ids written as JSON strings."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise ApiError(400, f"logit_bias keys must be token ids (non-negative integers), "
                           f"got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def now() -> int:
    return int(time.time())
