"""The kvmesh.v1.Generation gRPC service, as methods of the ingress (Serve's gRPC proxy calls the
method named like the RPC with the decoded request; Generate is server-streaming, so it is an async
generator). Errors become gRPC status codes: INVALID_ARGUMENT naming the field, NOT_FOUND for an
unknown model, ALREADY_EXISTS for a request_id in flight, UNAVAILABLE when overloaded.

Request identity: the server names every request (new_id) and only that name reaches the workers
and the engine. A client's `request_id` is a label scoped to its caller (the API key it sent; with
no keys configured every caller shares one scope): a label already in flight in the same scope is
refused before any work, and Abort finds only the caller's own labels. The table of labels in
flight is this ingress replica's own (with several ingress replicas, Abort reaches one of them;
cancelling the Generate call always works).

Cancellation: a client cancel or deadline reaches Generate as CancelledError; the worker call is
then cancelled, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import grpc

from kvmesh.cluster.auth import UNAUTHORIZED_MESSAGE, bearer_token, grpc_authorization
from kvmesh.cluster.generation import run_request
from kvmesh.cluster.openai_protocol import ApiError, new_id
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.sampling_params import SamplingParams

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


def _check_key(service, endpoint: str, grpc_context) -> None:
    if not service.api_keys.allows_grpc(endpoint, grpc_context):
        raise _grpc_error(ApiError(401, UNAUTHORIZED_MESSAGE, type="authentication_error",
                                   code="invalid_api_key"), grpc_context)


def sampling_from_proto(req: pb.GenerateRequest, default_max_tokens: int = 16) -> SamplingParams:
    kwargs = {"max_tokens": req.max_tokens if req.HasField("max_tokens") else default_max_tokens,
              "stop": list(req.stop), "ignore_eos": req.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs"):
        if req.HasField(name):
            kwargs[name] = getattr(req, name)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).split(" ", 1)[0]) from None


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


async def _stop(step: asyncio.Future | None) -> None:
    """Cancel a pending read of run_request and wait for it: run_request's cleanup then cancels
    the worker call, which aborts the request in the engine. (Closing run_request while a read
    still runs it fails, and the request would generate on.)"""
    if step is not None and not step.done():
        step.cancel()
        await asyncio.wait({step})


class GrpcService:
    """Mixed into the Ingress deployment (which provides self.frontend, self.hub, self.limits and
    self.api_keys)."""

    @property
    def _in_flight(self) -> dict[tuple[str, str], asyncio.Event]:
        """(caller, label) -> the event Abort sets. Made on first use: the Ingress's __init__
        (ingress.py) does not call a mixin's."""
        return self.__dict__.setdefault("_grpc_in_flight", {})

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None):
        arrival = time.time()
        _check_key(self, "api", grpc_context)
        engine_id = new_id("req")
        try:
            key = (_caller(self, grpc_context), _label(request, engine_id))
            if key in self._in_flight:  # checked and taken with no await between: no race
                raise ApiError(409, f"request_id: {key[1]!r} is already in flight for this "
                               "caller; use another label, or Abort it first",
                               param="request_id", code="request_id_in_flight")
        except ApiError as e:
            raise self._grpc_refused(e, grpc_context) from None
        abort = self._in_flight[key] = asyncio.Event()
        stream = None
        try:
            try:
                routed = await self._grpc_routed(request, arrival, engine_id)
            except ApiError as e:
                raise self._grpc_refused(e, grpc_context) from None
            stream = self._grpc_stream(routed, key[1], abort, grpc_context)
            async for out in stream:
                yield out
        finally:
            if stream is not None:  # left at a yield (the caller closed us): close it too
                await stream.aclose()
            self._in_flight.pop(key, None)

    async def _grpc_stream(self, routed, label: str, abort: asyncio.Event, grpc_context):
        deltas = run_request(self.frontend.workers, routed)
        aborted = asyncio.ensure_future(abort.wait())
        step = None
        num_tokens, first_token, last = 0, None, None
        try:
            while True:
                step = asyncio.ensure_future(deltas.__anext__())
                await asyncio.wait({step, aborted}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # Abort: stop the worker before answering
                    await _stop(step)
                    yield pb.GenerateResponse(request_id=label, finish_reason="abort",
                                              usage=pb.Usage(prompt_tokens=routed.num_prompt_tokens,
                                                             completion_tokens=num_tokens))
                    return
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    return
                except ApiError as e:  # overloaded: every replica and queue full
                    raise self._grpc_refused(e, grpc_context) from None
                if last is None and delta.finish_reason == "error" and not delta.token_ids:
                    raise _grpc_error(self.frontend.worker_error(delta, "prompt"), grpc_context)
                last = delta
                num_tokens += len(delta.token_ids)
                if delta.token_ids and first_token is None:
                    first_token = time.time()
                out = pb.GenerateResponse(request_id=label, token_ids=delta.token_ids,
                                          text=delta.text, finish_reason=delta.finish_reason or "",
                                          logprobs=delta.logprobs or [], error=delta.error or "")
                if delta.finished:
                    out.usage.CopyFrom(pb.Usage(
                        prompt_tokens=delta.num_prompt_tokens or routed.num_prompt_tokens,
                        completion_tokens=num_tokens, cached_tokens=delta.num_cached_tokens))
                yield out
                if delta.finished:
                    self.frontend.account(routed, first_token, delta, num_tokens, 200)
                    return
        finally:
            # A client cancel or deadline arrives as CancelledError, mostly while `step` waits
            # for the worker.
            aborted.cancel()
            await _stop(step)
            await deltas.aclose()

    def _grpc_refused(self, e: ApiError, grpc_context) -> Exception:
        self.frontend.metrics.observe_status(self.frontend.model_name, e.status)
        return _grpc_error(e, grpc_context)

    async def _grpc_routed(self, request: pb.GenerateRequest, arrival: float, engine_id: str):
        fe = self.frontend
        fe.check_model(request.model)
        if request.messages:
            msgs = [{"role": m.role, "content": m.content} for m in request.messages]
            prompt_ids, param = await fe.encode_chat(msgs), "messages"
        elif request.prompt:
            prompt_ids, param = await fe.encode_text(request.prompt), "prompt"
        else:
            prompt_ids, param = list(request.prompt_token_ids), "prompt_token_ids"
        self.limits.check_prompt(len(prompt_ids), param)
        info = await fe.check_prompt(prompt_ids, param)
        budget = self.limits.output_budget(
            request.max_tokens if request.HasField("max_tokens") else None,
            info.max_model_len - len(prompt_ids), "max_tokens")
        params = sampling_from_proto(request, default_max_tokens=min(16, budget))
        if params.max_tokens > info.max_model_len - len(prompt_ids):
            raise ApiError(400, f"max_tokens is {params.max_tokens} but only "
                           f"{info.max_model_len - len(prompt_ids)} tokens of context are left",
                           param="max_tokens")
        return fe.routed_request(prompt_ids, params, info, request.session_id or None,
                                 request_id=engine_id, arrival=arrival)

    async def Abort(self, request: pb.AbortRequest, grpc_context=None) -> pb.AbortResponse:
        _check_key(self, "api", grpc_context)
        event = self._in_flight.get((_caller(self, grpc_context), request.request_id))
        if event is not None:
            event.set()
        return pb.AbortResponse(found=event is not None)

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        _check_key(self, "health", grpc_context)
        loads, _ = await self.hub.loads.remote()
        healthy = [w for w, load in loads.items() if load.healthy]
        return pb.HealthResponse(healthy=bool(healthy), num_workers=len(healthy),
                                 model=self.frontend.model_name)

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context=None) -> pb.ListModelsResponse:
        _check_key(self, "api", grpc_context)
        info = await self.frontend.model_info()
        return pb.ListModelsResponse(models=[pb.Model(id=self.frontend.model_name,
                                                      max_model_len=info.max_model_len,
                                                      owned_by="kvmesh")])
