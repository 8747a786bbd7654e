"""The kvmesh.v1.Generation gRPC service, as methods of the ingress (Serve's gRPC proxy calls the
method named like the RPC with the decoded request; Generate is server-streaming, so it is an async
generator). Errors become gRPC status codes: INVALID_ARGUMENT naming the field, NOT_FOUND for an
unknown model, UNAVAILABLE when overloaded.

Abort works on the ingress replica that runs the request (the one a client reaches with one
ingress replica; with several, cancelling the Generate call is the reliable way).
"""

from __future__ import annotations

import asyncio
import time

import grpc

from kvmesh.cluster.auth import UNAUTHORIZED_MESSAGE
from kvmesh.cluster.generation import run_request
from kvmesh.cluster.openai_protocol import ApiError, new_id
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.sampling_params import SamplingParams

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           404: grpc.StatusCode.NOT_FOUND, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
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


class GrpcService:
    """Mixed into the Ingress deployment (which provides self.frontend and self.hub)."""

    _active: dict

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None):
        arrival = time.time()
        if not hasattr(self, "_active"):
            self._active = {}
        _check_key(self, "api", grpc_context)
        try:
            routed = await self._grpc_routed(request, arrival)
        except ApiError as e:
            self.frontend.metrics.observe_status(self.frontend.model_name, e.status)
            raise _grpc_error(e, grpc_context) from None
        abort = asyncio.Event()
        self._active[routed.request_id] = abort
        deltas = run_request(self.frontend.workers, routed)
        aborted = asyncio.ensure_future(abort.wait())
        num_tokens, first_token, last = 0, None, None
        try:
            while True:
                step = asyncio.ensure_future(deltas.__anext__())
                done, _ = await asyncio.wait({step, aborted}, return_when=asyncio.FIRST_COMPLETED)
                if step not in done:
                    step.cancel()  # closes the worker call (abort there) before we answer
                    await asyncio.wait({step})
                    yield pb.GenerateResponse(request_id=routed.request_id, finish_reason="abort",
                                              usage=pb.Usage(prompt_tokens=routed.num_prompt_tokens,
                                                             completion_tokens=num_tokens))
                    return
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    return
                except ApiError as e:  # overloaded: every replica and queue full
                    self.frontend.metrics.observe_status(self.frontend.model_name, e.status)
                    raise _grpc_error(e, grpc_context) from None
                if last is None and delta.finish_reason == "error" and not delta.token_ids:
                    raise _grpc_error(self.frontend.worker_error(delta, "prompt"), grpc_context)
                last = delta
                num_tokens += len(delta.token_ids)
                if delta.token_ids and first_token is None:
                    first_token = time.time()
                out = pb.GenerateResponse(request_id=routed.request_id, token_ids=delta.token_ids,
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
            aborted.cancel()
            self._active.pop(routed.request_id, None)
            await deltas.aclose()

    async def _grpc_routed(self, request: pb.GenerateRequest, arrival: float):
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
                                 request_id=request.request_id or new_id("req"), arrival=arrival)

    async def Abort(self, request: pb.AbortRequest, grpc_context=None) -> pb.AbortResponse:
        _check_key(self, "api", grpc_context)
        event = getattr(self, "_active", {}).get(request.request_id)
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
