"""The one request pipeline behind both protocols: the OpenAI HTTP routes (ingress.py) and the
kvmesh.v1.Generation gRPC service (grpc_service.py) are adapters that parse their wire request into
a `GenerationRequest`, call the pipeline, and render what it returns (TokenDeltas) or raises
(ApiError, which each maps to an HTTP status or a gRPC status code).

What the pipeline does, once for both:
- `authorize`: the API key check (401 / UNAUTHENTICATED);
- `admit`: the model name, the prompt (measured in characters, then tokenized, off the event loop
  when large: frontend.py), the prompt and output token limits, the sampling parameters, and the
  routed request (block hashes, session key) the KV-aware router reads;
- `stream` / `whole`: the workers, with failover while the client has seen no token
  (generation.run_request); a stream's first delta is awaited before the response starts, so a
  request the worker refuses still gets its 4xx; an Abort event ends a stream with finish_reason
  "abort"; closing a stream (the client went away) cancels the worker call, which aborts the
  request in the engine;
- metrics: every refusal is counted by status (`refused`), every finished request by status 200
  with its latencies and tokens (`kvmesh_requests_total` and the rest, metrics.py); a stream that
  ends with finish_reason "error" (its worker died or failed after it sent tokens) by status 503
  alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from ray.serve.exceptions import BackPressureError

from kvmesh.cluster.auth import UNAUTHORIZED_MESSAGE, ApiKeys
from kvmesh.cluster.frontend import Frontend
from kvmesh.cluster.generation import Collected, collect, overloaded, run_request
from kvmesh.cluster.limits import RequestLimits
from kvmesh.cluster.messages import RoutedRequest
from kvmesh.cluster.metrics import TokenGaps
from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.protocol import TokenDelta
from kvmesh.sampling_params import SamplingParams
from kvmesh.worker.chat_template import DEFAULT_OPTIONS, TemplateOptions

FAILED_STREAM_STATUS = 503  # kvmesh_requests_total status of a stream that ended in "error"


@dataclass
class Prompt:
    """One of: chat messages (the model's chat template is applied), text, or token ids. `param`
    is the request field that errors about the prompt name."""
    param: str
    messages: list[dict] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    tools: list[dict] | None = None  # for a chat template that renders tools (cluster/tool_calls.py)
    template: TemplateOptions = DEFAULT_OPTIONS  # how the chat template is applied
    # vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens once tokenized (-1: as
    # many as the server takes, limits.max_prompt_tokens or max_model_len - 1)
    truncate: int | None = None
    # a text prompt tokenized with the tokenizer's special tokens (e.g. BOS): vLLM's
    # add_special_tokens, on for completions; a chat's is in `template`
    add_special_tokens: bool = False


@dataclass
class GenerationRequest:
    """A generation request as both protocols ask it.

    `sampling` makes the SamplingParams from the output budget (the context left after the prompt,
    capped by limits.max_output_tokens); each protocol has its own fields and defaults, and raises
    ApiError naming its own field for a bad value. `max_tokens` is the output length the client
    asked for (None: not given), checked against the cap under the name `max_tokens_param`."""
    prompt: Prompt
    sampling: Callable[[int], SamplingParams]
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    model: str | None = None
    session_key: str | None = None
    request_id: str | None = None  # the server's name for it; None: a new one
    arrival: float = field(default_factory=time.time)
    cache_salt: str | None = None  # vLLM's: shares cached blocks only with the same salt
    priority: int = 0  # vLLM's: lower first in a worker's queue (engine.scheduling_policy "priority")


@dataclass
class Admitted:
    """A request that passed every check, ready for the workers."""
    routed: RoutedRequest
    prompt_param: str


class RequestPipeline:
    def __init__(self, frontend: Frontend, limits: RequestLimits, api_keys: ApiKeys):
        self.frontend = frontend
        self.limits = limits
        self.api_keys = api_keys

    # ---- before the workers --------------------------------------------------------------------

    def authorize(self, endpoint: str, authorization: str | None) -> None:
        """endpoint: "api", "health" or "metrics" (auth.py); authorization: the Authorization
        header (HTTP) or metadata (gRPC)."""
        if not self.api_keys.allows(endpoint, authorization):
            raise ApiError(401, UNAUTHORIZED_MESSAGE, type="authentication_error",
                           code="invalid_api_key")

    def refused(self, error: ApiError) -> ApiError:
        """Count a request answered with `error` (kvmesh_requests_total by status); returns it."""
        self.frontend.metrics.observe_status(self.frontend.model_name, error.status)
        return error

    async def admit(self, request: GenerationRequest) -> Admitted:
        try:
            return await self._admit(request)
        except BackPressureError:  # a worker call made here (model_info) found every queue full
            raise overloaded() from None

    async def _admit(self, request: GenerationRequest) -> Admitted:
        fe, prompt = self.frontend, request.prompt
        fe.check_model(request.model)
        self._check_priority(request.priority)
        if request.cache_salt is not None and not request.cache_salt:
            raise ApiError(400, "cache_salt: an empty salt; leave it out or give a non-empty string",
                           param="cache_salt")
        prompt_ids = await self._prompt_ids(prompt)
        if prompt.truncate is not None:
            prompt_ids = prompt_ids[-await self._kept_tokens(prompt.truncate):]
        self.limits.check_prompt(len(prompt_ids), prompt.param)
        info = await fe.check_prompt(prompt_ids, prompt.param)
        context_left = info.max_model_len - len(prompt_ids)
        budget = self.limits.output_budget(request.max_tokens, context_left,
                                           request.max_tokens_param)
        params = request.sampling(budget)
        reasoning = fe.reasoning
        if (reasoning is not None and params.structured_outputs is not None
                and not fe.config.server.structured_outputs_in_reasoning
                and reasoning.grammar_waits(prompt_ids)):  # vLLM's: the grammar after </think>
            params = dataclasses.replace(params, reasoning_end_token_id=reasoning.end_id)
        if info.vocab_size is not None:
            _check_token_ids(params, info.vocab_size)
        if params.max_tokens > context_left:
            raise ApiError(400, f"{request.max_tokens_param} is {params.max_tokens} but only "
                           f"{context_left} tokens of context are left after the prompt",
                           param=request.max_tokens_param)
        routed = fe.routed_request(prompt_ids, params, info, request.session_key,
                                   request_id=request.request_id, arrival=request.arrival,
                                   cache_salt=request.cache_salt, priority=request.priority)
        return Admitted(routed, prompt.param)

    def _check_priority(self, priority: int) -> None:
        if priority and self.frontend.config.engine.scheduling_policy != "priority":
            raise ApiError(400, f"priority is {priority}, but the server schedules first come, first "
                           "served (engine.scheduling_policy fcfs): only 0 is accepted", param="priority")

    async def _kept_tokens(self, truncate: int) -> int:
        longest = (await self.frontend.model_info()).max_model_len - 1
        if self.limits.max_prompt_tokens is not None:
            longest = min(longest, self.limits.max_prompt_tokens)
        if truncate == -1:
            return longest
        if truncate > longest:
            raise ApiError(400, f"truncate_prompt_tokens is {truncate}; a prompt may have at most {longest} "
                           "tokens here", param="truncate_prompt_tokens")
        return truncate

    async def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            return await self.frontend.encode_chat(prompt.messages, prompt.tools, prompt.template)
        if prompt.text is not None:
            return await self.frontend.encode_text(prompt.text, prompt.add_special_tokens)
        return list(prompt.token_ids or [])

    # ---- on the workers ------------------------------------------------------------------------

    async def stream(self, admitted: Admitted, abort: asyncio.Event | None = None,
                     beside_others: bool = False) -> "DeltaStream":
        """The request's deltas, its first one already received (a refusal before any token is
        raised here, as ApiError). Use it as `async with stream: async for delta in stream`.
        `beside_others`: one of several prompts of a client request, started at once."""
        stream = DeltaStream(self.frontend, admitted, abort, beside_others)
        try:
            await stream.start()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def streams_of_several(self, admitted: list[Admitted]) -> list["DeltaStream"]:
        """Several prompts' streams (a list of prompts in one streamed completions request),
        started at once, in prompt order. If one is refused, the others are closed (aborted) and
        its error raised, as one prompt's would be."""
        tasks = [asyncio.ensure_future(self.stream(request, beside_others=True))
                 for request in admitted]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            for started in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(started, DeltaStream):
                    await started.aclose()
            raise

    async def whole(self, admitted: Admitted, beside_others: bool = False) -> Collected:
        """The whole completion (non-streaming: retried from the start on another worker when its
        worker dies, since the client has seen nothing yet)."""
        routed = admitted.routed
        result = Collected()
        try:
            await collect(self.frontend.workers, routed, self.frontend.count_retry, out=result,
                          own_call_id=beside_others)
        except asyncio.CancelledError:  # the client went away (or its deadline passed): aborted
            self.frontend.account_abort(routed, len(result.token_ids), result.token_gaps.gaps)
            raise
        self.frontend.learn_token_texts(result.token_texts)
        last = result.last
        if last is None:
            raise ApiError(503, "no result")
        if last.finish_reason == "error":
            raise self.frontend.worker_error(last, admitted.prompt_param)
        self.frontend.account(routed, result.first_token_seen, last, len(result.token_ids), 200,
                              result.token_gaps.gaps)
        return result

    async def whole_of_several(self, admitted: list[Admitted]) -> list[Collected]:
        """Several prompts' whole completions (a list of prompts in one completions request), run
        at once as vLLM runs them, in prompt order. Each is a `whole` request of its own: a worker
        that dies is survived by running that prompt again elsewhere; a prompt that fails fails
        the request (503, as one prompt would), and the others are then cancelled (aborted)."""
        tasks = [asyncio.ensure_future(self.whole(request, beside_others=True))
                 for request in admitted]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed (or the client went): stop the others
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in the sampling fields are the model's (the engine checks again)."""
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("logit_bias", list(params.logit_bias or ()))):
        if any(t >= vocab_size for t in ids):
            raise ApiError(400, f"{name} must be token ids in [0, {vocab_size}), got {max(ids)}",
                           param=name)


class DeltaStream:
    """An admitted request's TokenDeltas as an async iterator (the last one finished). When the
    consumer asks past the last, the request is counted (status 200, latencies, tokens; status 503
    alone when it ended with finish_reason "error"). Closing it early (the client went away)
    cancels the worker call, which aborts the request in the engine. With an `abort` event,
    setting it stops the worker call and ends the stream with an "abort" delta (not counted: no
    answer was completed)."""

    def __init__(self, frontend: Frontend, admitted: Admitted, abort: asyncio.Event | None,
                 beside_others: bool = False):
        self.frontend = frontend
        self.routed = admitted.routed
        self.prompt_param = admitted.prompt_param
        self.num_tokens = 0
        self.last: TokenDelta | None = None
        self._first_token_time: float | None = None
        self._token_gaps = TokenGaps()
        self._deltas = run_request(frontend.workers, self.routed, on_retry=frontend.count_retry,
                                   own_call_id=beside_others)
        self._aborted = asyncio.ensure_future(abort.wait()) if abort is not None else None
        self._step: asyncio.Future | None = None
        self._first: TokenDelta | None = None
        self._counted = False
        self._started = False

    async def start(self) -> None:
        first = await self._next()
        if first.finished and first.finish_reason == "error" and not first.token_ids:
            raise self.frontend.worker_error(first, self.prompt_param)
        self._first = first
        self._started = True  # from here on, closing it unfinished counts as an abort

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenDelta:
        if self.last is not None and self.last.finished:
            self._count()
            raise StopAsyncIteration
        delta = self._first if self._first is not None else await self._next()
        self._first = None
        self.last = delta
        return delta

    async def _next(self) -> TokenDelta:
        delta = await self._read()
        self.frontend.learn_token_texts(delta.token_texts)
        self.num_tokens += len(delta.token_ids)
        self._token_gaps.add(delta)
        if delta.token_ids and self._first_token_time is None:
            self._first_token_time = time.time()
        return delta

    async def _read(self) -> TokenDelta:
        if self._aborted is None:
            return await self._deltas.__anext__()
        self._step = asyncio.ensure_future(self._deltas.__anext__())
        await asyncio.wait({self._step, self._aborted}, return_when=asyncio.FIRST_COMPLETED)
        if not self._step.done():  # Abort: stop the worker before answering
            await _stop(self._step)
            return TokenDelta(self.routed.request_id, [], "", finish_reason="abort",
                              num_prompt_tokens=self.routed.num_prompt_tokens)
        return self._step.result()

    def _count(self) -> None:
        if self._counted or self.last.finish_reason == "abort":  # an abort: counted by aclose
            return
        self._counted = True
        # "error" after tokens (its worker died or failed mid-stream): the request failed, as a
        # non-streamed one that fails is answered 503, so neither it nor its tokens are a success
        status = FAILED_STREAM_STATUS if self.last.finish_reason == "error" else 200
        self.frontend.account(self.routed, self._first_token_time, self.last,
                              self.num_tokens, status, self._token_gaps.gaps)

    async def aclose(self) -> None:
        if not self._counted and self._started:  # ended before it finished: aborted
            self._counted = True
            self.frontend.account_abort(self.routed, self.num_tokens, self._token_gaps.gaps)
        if self._aborted is not None:
            self._aborted.cancel()
        await _stop(self._step)
        await self._deltas.aclose()

    async def __aenter__(self) -> "DeltaStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


async def _stop(step: asyncio.Future | None) -> None:
    """Cancel a pending read of run_request and wait for it: run_request's cleanup then cancels
    the worker call, which aborts the request in the engine. (Closing run_request while a read
    still runs it fails, and the request would generate on.)"""
    if step is not None and not step.done():
        step.cancel()
        await asyncio.wait({step})
