"""The kvmesh.v1.Generation gRPC service, as methods of the ingress (Serve's gRPC proxy calls the
method named like the RPC with the decoded request; Generate is server-streaming, so it is an async
generator). Errors become gRPC status codes: INVALID_ARGUMENT naming the field, NOT_FOUND for an
unknown model, ALREADY_EXISTS for a request_id in flight, RESOURCE_EXHAUSTED when overloaded,
UNAVAILABLE when no worker could serve it.

Request identity: the server names every request (new_id) and only that name reaches the workers
and the engine. A client's `request_id` is a label scoped to its caller (the API key it sent; with
no keys configured every caller shares one scope): a label already in flight in the same scope is
refused before any work, and Abort finds only the caller's own labels. The table of labels in
flight is this ingress replica's own (with several ingress replicas, Abort reaches one of them;
cancelling the Generate call always works).

The rest (auth, limits, tokenizing, routing, failover, Abort, metrics) is the request pipeline
HTTP uses too (pipeline.py); this module parses GenerateRequest into it and renders its deltas.
What a request asks beyond sampling (structured outputs, tools, echo, prompt logprobs) is read and
rendered by grpc_fields.py.

Cancellation: a client cancel or deadline reaches Generate as CancelledError (serve_grpc_cancel.py
makes sure of it); closing the stream then cancels the worker call, which aborts the request in
the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import grpc

from kvmesh.cluster.auth import bearer_token, grpc_authorization
from kvmesh.cluster.grpc_fields import (GrpcAsk, ResponseShape, chat_messages, chat_template_options,
                                        prompt_logprobs_asked, read_ask)
from kvmesh.cluster.openai_protocol import ApiError, new_id
from kvmesh.cluster.openai_request import check_chat_template, checked_truncation
from kvmesh.cluster.pipeline import DeltaStream, GenerationRequest, Prompt
from kvmesh.cluster.status import cluster_health
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.protocol import TokenDelta
from kvmesh.sampling_params import SamplingParams
from kvmesh.structured_outputs import StructuredOutputs

MAX_LABEL_CHARS = 256  # a client's request_id is kept in memory while its request runs

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ALREADY_EXISTS,
           429: grpc.StatusCode.RESOURCE_EXHAUSTED,
           503: grpc.StatusCode.UNAVAILABLE}


def _grpc_error(e: ApiError, grpc_context) -> Exception:
    """Serve's gRPC proxy answers with the status code set on grpc_context before the raise."""
    if grpc_context is not None:
        grpc_context.set_code(_STATUS.get(e.status, grpc.StatusCode.INTERNAL))
        # Serve's gRPC proxy drops trailing metadata on errors: the retry hint goes in the details.
        retry = f" (retry-after: {int(e.retry_after_s)} s)" if e.retry_after_s else ""
        grpc_context.set_details(e.message + retry)
    return RuntimeError(e.message)


def sampling_from_proto(req: pb.GenerateRequest, default_max_tokens: int = 16,
                        structured: StructuredOutputs | None = None) -> SamplingParams:
    """`structured`: the request's constraint, built once before admission (grpc_fields.read_ask)."""
    kwargs = {"max_tokens": req.max_tokens if req.HasField("max_tokens") else default_max_tokens,
              "stop": list(req.stop), "ignore_eos": req.ignore_eos,
              "min_tokens": req.min_tokens, "stop_token_ids": list(req.stop_token_ids),
              "include_stop_str_in_output": req.include_stop_str_in_output,
              "logit_bias": dict(req.logit_bias) or None,
              "allowed_token_ids": list(req.allowed_token_ids) or None,
              "bad_words": list(req.bad_words) or None,
              "prompt_logprobs": prompt_logprobs_asked(req)}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "skip_special_tokens", "n", "best_of"):
        if req.HasField(name):
            kwargs[name] = getattr(req, name)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    if req.HasField("best_of") and req.best_of != kwargs.get("n", 1):
        raise ApiError(400, "best_of must equal n on Generate: it streams, and the best sequences "
                       "are known only when all have finished (use /v1/completions)", param="best_of")
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).split(" ", 1)[0]) from None


def generation_request(request: pb.GenerateRequest, arrival: float, engine_id: str,
                       ask: GrpcAsk | None = None, tokenizer=None) -> GenerationRequest:
    """The pipeline's request for a GenerateRequest: messages, else prompt, else prompt_token_ids;
    max_tokens defaults to 16 (or the output budget, if smaller). `ask`: what read_ask read of it
    (its constraint, built once; its tools, rendered into the chat with `tokenizer`)."""
    ask = ask or GrpcAsk()
    truncate = checked_truncation(request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens")
                                  else None)
    if request.messages:
        messages, template_tools = chat_messages(request, ask.tools, tokenizer)
        prompt = Prompt("messages", messages=messages, tools=template_tools,
                        template=chat_template_options(request, tokenizer, messages), truncate=truncate)
    elif request.prompt:
        prompt = Prompt("prompt", text=request.prompt, truncate=truncate,
                        add_special_tokens=request.add_special_tokens if request.HasField("add_special_tokens") else True)
    else:
        prompt = Prompt("prompt_token_ids", token_ids=list(request.prompt_token_ids), truncate=truncate)
    structured = ask.structured.spec if ask.structured is not None else None
    return GenerationRequest(
        prompt, lambda budget: sampling_from_proto(request, min(16, budget), structured),
        max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
        model=request.model, session_key=request.session_id or None, request_id=engine_id,
        arrival=arrival, priority=request.priority,
        cache_salt=request.cache_salt if request.HasField("cache_salt") else None)


def _caller(service, grpc_context) -> str:
    """The scope of the caller's labels: a digest of its API key (so the table of labels holds no
    key); "" when no keys are configured, so all callers share one scope."""
    if not service.api_keys.enabled:
        return ""
    key = bearer_token(grpc_authorization(grpc_context)) or ""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _label(request: pb.GenerateRequest, engine_id: str) -> str:
    if len(request.request_id) > MAX_LABEL_CHARS:
        raise ApiError(400, f"request_id: at most {MAX_LABEL_CHARS} characters "
                       f"(got {len(request.request_id)})", param="request_id")
    return request.request_id or engine_id


def _response(delta: TokenDelta, label: str, stream: DeltaStream) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id=label, token_ids=delta.token_ids, text=delta.text,
                              finish_reason=delta.finish_reason or "",
                              logprobs=delta.logprobs or [], error=delta.error or "",
                              index=delta.index, worker_id=delta.worker_id)
    if isinstance(delta.stop_reason, str):
        out.stop_string = delta.stop_reason
    elif isinstance(delta.stop_reason, int):
        out.stop_token_id = delta.stop_reason
    if delta.finished:
        out.usage.CopyFrom(pb.Usage(
            prompt_tokens=delta.num_prompt_tokens or stream.routed.num_prompt_tokens,
            completion_tokens=stream.num_tokens, cached_tokens=delta.num_cached_tokens))
    return out


class GrpcService:
    """Mixed into the Ingress deployment (which provides self.pipeline, self.frontend,
    self.hub_loads and self.api_keys)."""

    @property
    def _in_flight(self) -> dict[tuple[str, str], asyncio.Event]:
        """(caller, label) -> the event Abort sets. Made on first use: the Ingress's __init__
        (ingress.py) does not call a mixin's."""
        return self.__dict__.setdefault("_grpc_in_flight", {})

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None):
        arrival = time.time()
        engine_id = new_id("req")
        try:
            self._authorize("api", grpc_context)
            key = (_caller(self, grpc_context), _label(request, engine_id))
            if key in self._in_flight:  # checked and taken with no await between: no race
                raise ApiError(409, f"request_id: {key[1]!r} is already in flight for this "
                               "caller; use another label, or Abort it first",
                               param="request_id", code="request_id_in_flight")
        except ApiError as e:
            raise self._grpc_refused(e, grpc_context) from None
        abort = self._in_flight[key] = asyncio.Event()
        try:
            try:
                ask = read_ask(request)
                if request.HasField("chat_template"):
                    check_chat_template(request, self.config.server.trust_request_chat_template)
                if ask.structured is not None:  # built once, compiled here (off the loop)
                    await self.frontend.check_grammar(ask.structured.spec, ask.structured.param)
                admitted = await self.pipeline.admit(generation_request(
                    request, arrival, engine_id, ask, self.frontend.tokenizer))
                stream = await self.pipeline.stream(admitted, abort)
            except ApiError as e:
                raise self._grpc_refused(e, grpc_context) from None
            shape = ResponseShape(request, ask, admitted.routed.prompt_token_ids,
                                  self.frontend.tokenizer.decode, self.frontend.reasoning)
            async with stream:  # a cancel or deadline arrives as CancelledError: closes it
                try:
                    async for delta in stream:
                        yield shape.apply(_response(delta, key[1], stream), delta)
                except ApiError as e:  # overloaded when re-run after its worker died
                    raise self._grpc_refused(e, grpc_context) from None
        finally:
            self._in_flight.pop(key, None)

    async def Abort(self, request: pb.AbortRequest, grpc_context=None) -> pb.AbortResponse:
        self._check_key("api", grpc_context)
        event = self._in_flight.get((_caller(self, grpc_context), request.request_id))
        if event is not None:
            event.set()
        return pb.AbortResponse(found=event is not None)

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        self._check_key("health", grpc_context)
        answer = await self.hub_loads.get()  # None: the hub did not answer in time
        health = cluster_health(answer and answer[0], self.config.scales_to_zero)
        return pb.HealthResponse(healthy=health.serving, num_workers=health.workers,
                                 model=self.frontend.model_name)

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context=None) -> pb.ListModelsResponse:
        self._check_key("api", grpc_context)
        info = await self.frontend.model_info()
        return pb.ListModelsResponse(models=[pb.Model(id=self.frontend.model_name,
                                                      max_model_len=info.max_model_len,
                                                      owned_by="kvmesh")])

    def _authorize(self, endpoint: str, grpc_context) -> None:
        self.pipeline.authorize(endpoint, grpc_authorization(grpc_context))

    def _check_key(self, endpoint: str, grpc_context) -> None:
        try:
            self._authorize(endpoint, grpc_context)
        except ApiError as e:
            raise self._grpc_refused(e, grpc_context) from None

    def _grpc_refused(self, e: ApiError, grpc_context) -> Exception:
        return _grpc_error(self.pipeline.refused(e), grpc_context)
