"""What the ingress does with a request before and after the workers: tokenize (with the chat
template), check limits, hash the prompt's full blocks for the router, and account the result.
Shared by the OpenAI HTTP routes and the gRPC service.

Tokenizing is the one piece of request work whose cost grows with what a client sends, so a prompt
is measured in characters first (refused over `limits.max_prompt_chars` before any tokenizing),
and a long one is tokenized on a thread: the ingress's event loop, which streams every other
client's tokens, never waits for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import jinja2

from kvmesh.cluster.generation import MAX_ATTEMPTS, WORKER_GONE
from kvmesh.cluster.messages import ModelInfo, RoutedRequest
from kvmesh.cluster.metrics import IngressMetrics
from kvmesh.cluster.openai_protocol import ApiError, new_id
from kvmesh.cluster.reasoning import ReasoningParser
from kvmesh.hashing import block_hashes, tenant_salt
from kvmesh.protocol import PromptSizeError, TokenDelta, check_prompt_size
from kvmesh.sampling_params import SamplingParams
from kvmesh.serve_config import ServeConfig
from kvmesh.worker.chat_template import DEFAULT_OPTIONS, TemplateOptions, encode_chat

logger = logging.getLogger("kvmesh.cluster")

# Prompts up to this many characters tokenize in well under a millisecond: on the event loop.
INLINE_TOKENIZE_CHARS = 4096
# Without limits.max_prompt_chars: this many characters per token of the prompt-token limit, more
# than any vocabulary's tokens hold on average, so no prompt that fits in tokens is refused.
CHARS_PER_TOKEN_BOUND = 32


# The request fields the engine's own refusals begin with (n / best_of over max_num_seqs, token
# ids outside the vocabulary, a grammar with no token left); kvmesh.SamplingParams names them as
# the OpenAI / vLLM fields.
ENGINE_NAMED_FIELDS = ("n", "best_of", "stop_token_ids", "logit_bias", "structured_outputs")


def message_chars(message: dict) -> int:
    """A chat message's characters as the template gets them: its content, and the JSON of what else
    it carries there (an assistant's tool calls with their arguments, a tool call's id, a name)."""
    num_chars = len(message.get("content") or "")
    for key, value in message.items():
        if key not in ("role", "content") and value is not None:
            num_chars += len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))
    return num_chars


class Frontend:
    def __init__(self, config: ServeConfig, worker_handle):
        from kvmesh.worker.loader import load_tokenizer

        self.config = config
        self.workers = worker_handle
        self.tokenizer, self.model_name = load_tokenizer(config.model)
        # server.reasoning_parser (cluster/reasoning.py), bound to this tokenizer's markers
        self.reasoning = (ReasoningParser.for_tokenizer(config.server.reasoning_parser, self.tokenizer)
                          if config.server.reasoning_parser is not None else None)
        self.model_aliases = {self.model_name, config.model}
        self.metrics = IngressMetrics()
        self.metrics.init_model(self.model_name)
        self._info: ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        self._token_texts: dict[int, str] = {}  # from the engine processes (learn_token_texts)
        self.token_text_misses = 0  # decode_token calls the engine sent no text for (expected 0)
        # One thread: a tokenizer is not safe to call from two at once, and small prompts do not
        # queue behind large ones (they stay on the loop).
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-tokenize")
        self._grammars = None  # worker.grammar.GrammarCompiler, made on the first structured request

    # ---- model ---------------------------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        """Asked of a worker once (max_model_len depends on the loaded model and the engine)."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    self._info = await self._ask_model_info()
        return self._info

    async def _ask_model_info(self) -> ModelInfo:
        """A worker that dies while asked is not the answer: the next call goes to another (the
        dead one has left the router's replica set), as a request is re-run (generation.py)."""
        for attempt in range(MAX_ATTEMPTS):
            try:
                return await self.workers.model_info.remote()
            except WORKER_GONE as e:
                logger.warning("kvmesh: a worker died while asked for the model (attempt %d): %r",
                               attempt + 1, e)
                error = e
        raise ApiError(503, f"no worker could answer after {MAX_ATTEMPTS} attempts: "
                       f"{type(error).__name__}", type="server_error", code="worker_failed",
                       retry_after_s=1)

    def check_model(self, model: str | None, required: bool = False) -> None:
        """404 unless `model` names the served model or an alias (a request may leave it out
        unless `required`)."""
        if (model or required) and model not in self.model_aliases:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    # ---- prompts -------------------------------------------------------------------------------

    async def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          options: TemplateOptions = DEFAULT_OPTIONS) -> list[int]:
        if options.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"the model {self.model_name!r} has no chat template; use /v1/completions",
                           param="messages")
        num_chars = sum(message_chars(m) for m in messages)
        if tools:
            num_chars += len(json.dumps(tools))
        if options.kwargs:
            num_chars += len(json.dumps(options.kwargs))
        if options.documents:
            num_chars += len(json.dumps(options.documents))
        await self._check_chars(num_chars, "messages")
        # Tokenized exactly as kvmesh.LLM.chat does, so a served chat equals an offline one.
        try:
            return await self._tokenize(num_chars, encode_chat, self.tokenizer, messages,
                                        self.config.server.special_tokens_in_content, tools=tools,
                                        options=options)
        except (jinja2.TemplateError, ValueError) as e:  # the template refused these messages
            param = ("chat_template" if options.chat_template is not None
                     else "chat_template_kwargs" if options.kwargs else "messages")
            whose = "the request's" if options.chat_template is not None else "the model's"
            raise ApiError(400, f"{param}: {whose} chat template failed on this request: {e}",
                           param=param) from None

    async def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        await self._check_chars(len(text), "prompt")
        return await self._tokenize(len(text), self.tokenizer.encode, text,
                                    add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids as text (special tokens kept, as vLLM's /detokenize); off the loop when long."""
        if len(token_ids) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.decode(token_ids)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.tokenizer.decode, token_ids)

    async def max_prompt_chars(self) -> int:
        limits = self.config.limits
        if limits.max_prompt_chars is not None:
            return limits.max_prompt_chars
        max_tokens = limits.max_prompt_tokens or (await self.model_info()).max_model_len
        return CHARS_PER_TOKEN_BOUND * max_tokens

    async def _check_chars(self, num_chars: int, param: str) -> None:
        limit = await self.max_prompt_chars()
        if num_chars > limit:
            source = ("limits.max_prompt_chars" if self.config.limits.max_prompt_chars is not None
                      else f"{CHARS_PER_TOKEN_BOUND} x the prompt token limit; limits.max_prompt_chars")
            raise ApiError(400, f"the prompt is {num_chars} characters; the limit is {limit} "
                           f"({source})", param=param, code="context_length_exceeded")

    async def _tokenize(self, num_chars: int, fn, *args, **kwargs) -> list[int]:
        if num_chars <= INLINE_TOKENIZE_CHARS:
            return list(fn(*args, **kwargs))
        loop = asyncio.get_running_loop()
        return list(await loop.run_in_executor(self._tokenize_pool, lambda: fn(*args, **kwargs)))

    def learn_token_texts(self, texts: dict[int, str] | None) -> None:
        """Token texts the engine process sent with a delta (TokenDelta.token_texts)."""
        if texts:
            self._token_texts.update(texts)  # bounded by the vocabulary

    def decode_token(self, token_id: int) -> str:
        """A logprob token's text: the engine process decodes it and sends it with the delta that
        names the token (it owns output detokenization); the ingress does not decode it again."""
        text = self._token_texts.get(token_id)
        if text is None:  # not expected: counted, and decoded here so the answer is still whole
            self.token_text_misses += 1
            logger.warning("token %d reached the ingress without its text", token_id)
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    async def check_prompt(self, prompt_ids: list[int], param: str) -> ModelInfo:
        info = await self.model_info()
        try:
            check_prompt_size(len(prompt_ids), info.max_model_len)
        except PromptSizeError as e:
            raise ApiError(400, str(e), param=param,
                           code="context_length_exceeded" if e.too_long else None) from None
        return info

    def routed_request(self, prompt_ids: list[int], params: SamplingParams, info: ModelInfo,
                       session_key: str | None, request_id: str | None = None,
                       arrival: float | None = None, cache_salt: str | None = None,
                       priority: int = 0) -> RoutedRequest:
        return RoutedRequest(
            request_id=request_id or new_id("req"), prompt_token_ids=prompt_ids,
            sampling_params=params,
            block_hashes=block_hashes(prompt_ids, info.block_size, tenant_salt(info.hash_salt, cache_salt)),
            hash_block_size=info.block_size,
            session_key=session_key, arrival_time=arrival or time.time(), cache_salt=cache_salt or None,
            priority=priority)

    # ---- structured outputs ------------------------------------------------------------------

    async def check_grammar(self, spec, param: str) -> None:
        """ApiError(400) naming `param` if the spec does not compile. Compiled on the grammar
        compiler's thread (never on the event loop) and cached, as the engine compiles it again."""
        from kvmesh.worker.grammar import GrammarError

        if self._grammars is None:
            from kvmesh.worker.grammar import GrammarCompiler

            vocab = (await self.model_info()).vocab_size or len(self.tokenizer)
            self._grammars = GrammarCompiler(self.tokenizer, vocab)
        try:
            await asyncio.wrap_future(self._grammars.submit(spec))
        except GrammarError as e:
            message = str(e).split(": ", 1)[-1]
            raise ApiError(400, f"{param}: {message}", param=param) from None

    # ---- results -------------------------------------------------------------------------------

    @staticmethod
    def worker_error(delta: TokenDelta, param: str) -> ApiError:
        """The error to answer for a request that ended in an error, before its first token or
        after some. The engine's refusals (worker/engine.py; after some tokens: a grammar leading
        where no token fits) are the request's 400: one about a request field names it first, and
        that field is the `param`; any other is about the prompt (`param`). Anything else is the
        worker's failure, a 503 to retry."""
        message = delta.error or "the request failed"
        if message.startswith("invalid_request: "):
            message = message[len("invalid_request: "):]
            field = message.split(" ", 1)[0].rstrip(":")
            return ApiError(400, message, param=field if field in ENGINE_NAMED_FIELDS else param)
        return ApiError(503, message, type="server_error", code="worker_failed", retry_after_s=1)

    def account(self, routed: RoutedRequest, first_token: float | None, last: TokenDelta | None,
                num_output_tokens: int, status: int, token_gaps: list[float] = ()) -> None:
        self.metrics.observe_status(self.model_name, status)
        if last is None or status != 200:
            return
        end = time.time()
        prompt_tokens = last.num_prompt_tokens or routed.num_prompt_tokens
        self.metrics.observe_request(
            self.model_name, routed.arrival_time, first_token, end,
            prompt_tokens, num_output_tokens, last.num_cached_tokens)
        self.metrics.observe_engine_times(self.model_name, last, first_token, end,
                                          num_output_tokens, prompt_tokens,
                                          last.num_cached_tokens, routed.arrival_time, token_gaps)

    def account_abort(self, routed: RoutedRequest, num_output_tokens: int,
                      token_gaps: list[float] = ()) -> None:
        """A request that ended before it finished: its client went away or aborted it, streamed
        or not."""
        self.metrics.observe_abort(self.model_name, routed.num_prompt_tokens, num_output_tokens,
                                   token_gaps)

    def count_retry(self) -> None:
        """A request sent again after its worker died (counted whatever the request's end)."""
        self.metrics.retries.labels(model=self.model_name).inc()
