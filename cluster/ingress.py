"""The ingress deployment: OpenAI-compatible HTTP (FastAPI on Serve's HTTP proxy) and the
kvmesh.v1.Generation gRPC service (Serve's gRPC proxy calls the methods named like the RPCs).

Each ingress replica holds a handle to the workers, so Serve gives it a copy of the KV-aware request
router (request_router.py). Errors are OpenAI's error JSON with the right status; a client that
disconnects cancels its stream, which aborts the request on the worker.
"""

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError

from kvmesh.cluster import process_metrics
from kvmesh.cluster.auth import UNAUTHORIZED_MESSAGE, ApiKeys
from kvmesh.cluster.event_hub import get_or_create_hub
from kvmesh.cluster.frontend import Frontend
from kvmesh.cluster.generation import collect, overloaded, run_request
from kvmesh.cluster.grpc_service import GrpcService
from kvmesh.cluster.limits import RequestLimits
from kvmesh.cluster.status import worker_rows
from kvmesh.cluster.text_checks import lone_surrogate_path
from kvmesh.cluster.openai_protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                            chat_prompt_text, error_body, new_id, now,
                                            parse_request, sampling_params)
from kvmesh.cluster.openai_responses import SSE_DONE, Shaper, sse
from kvmesh.serve_config import parse_config

# FastAPI's own docs routes answer anyone: off here, and served by the ingress below (behind the
# API key) only when server.api_docs is on.
app = FastAPI(title="kvmesh", description="OpenAI-compatible API of a kvmesh cluster",
              docs_url=None, redoc_url=None, openapi_url=None)


def _error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(int(e.retry_after_s))} if e.retry_after_s else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


@serve.ingress(app)
class Ingress(GrpcService):
    def __init__(self, workers, config: dict):
        self.config = parse_config(config)
        self.frontend = Frontend(self.config, workers)
        self.hub = get_or_create_hub(self.config.app_name)
        self.api_keys = ApiKeys.from_server_config(self.config.server)
        self.limits = RequestLimits(self.config.limits)
        process_metrics.register(self.frontend.metrics.registry)
        if self.config.server.direct_http_port:  # the same app on this replica's own server
            from kvmesh.cluster.direct_http import serve_direct, shared_socket

            sock = shared_socket(self.config.server.host, self.config.server.direct_http_port)
            self._direct_http = asyncio.get_running_loop().create_task(
                serve_direct(app, sock, self.config.server))
        # The first handle call creates this replica's router copy: make it now, so the copy has
        # consumed the KV event stream before the first real request.
        asyncio.get_running_loop().create_task(self._warm_up())

    async def _warm_up(self):
        try:
            await self.frontend.model_info()
        except Exception:  # no worker yet: the first request will ask again
            pass

    # ---- HTTP: info ----------------------------------------------------------------------------

    @app.get("/health")
    async def health(self, request: Request):
        if (denied := self._auth(request, "health")) is not None:
            return denied
        loads, _ = await self.hub.loads.remote()
        healthy = [w for w, load in loads.items() if load.healthy]
        body = {"status": "ok" if healthy else "no_workers", "workers": len(healthy)}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/v1/models")
    async def models(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        info = await self.frontend.model_info()
        return {"object": "list", "data": [{
            "id": self.frontend.model_name, "object": "model", "created": 0, "owned_by": "kvmesh",
            "max_model_len": info.max_model_len, "vocab_size": info.vocab_size}]}

    @app.get("/v1/kvmesh/workers")
    async def workers(self, request: Request):
        """Per-worker load, KV usage and prefix hit rate (what `kvmesh status` prints)."""
        if (denied := self._auth(request)) is not None:
            return denied
        loads, stats = await self.hub.loads.remote()
        return {"model": self.frontend.model_name, "workers": worker_rows(loads, stats)}

    @app.get("/metrics")
    async def metrics(self, request: Request):
        if (denied := self._auth(request, "metrics")) is not None:
            return denied
        loads, stats = await self.hub.loads.remote()
        return Response(self.frontend.metrics.render(loads, stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        if (denied := self._docs_denied(request)) is not None:
            return denied
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        if (denied := self._docs_denied(request)) is not None:
            return denied
        return get_swagger_ui_html(openapi_url=f"{self.config.route_prefix.rstrip('/')}/openapi.json",
                                   title="kvmesh API")

    def _docs_denied(self, request: Request) -> JSONResponse | None:
        if not self.config.server.api_docs:
            return JSONResponse(error_body("the API docs are off (server.api_docs)",
                                           "invalid_request_error", None, "not_found"), status_code=404)
        return self._auth(request)

    # ---- HTTP: generation ----------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: str):
        arrival = time.time()
        if (denied := self._auth(request)) is not None:
            return denied
        routed = None
        try:
            try:
                body = json.loads(await self.limits.read_body(request))
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
                raise ApiError(400, f"the request body is not valid JSON: {e}") from None
            if (bad := lone_surrogate_path(body)) is not None:
                raise ApiError(400, f"{bad}: holds an unpaired UTF-16 surrogate (not valid "
                               "Unicode text)", param=bad)
            cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
            req = parse_request(body, cls)
            self.frontend.check_model(req.model)
            prompt_ids, param = await self._prompt_ids(req, kind)
            self.limits.check_prompt(len(prompt_ids), param)
            info = await self.frontend.check_prompt(prompt_ids, param)
            max_param = ("max_completion_tokens" if getattr(req, "max_completion_tokens", None)
                         is not None else "max_tokens")
            params = sampling_params(req, self.limits.output_budget(
                getattr(req, max_param), info.max_model_len - len(prompt_ids), max_param))
            session = request.headers.get(self.config.routing.session_header) or req.user
            routed = self.frontend.routed_request(prompt_ids, params, info, session, arrival=arrival)
            shaper = Shaper(kind, new_id("chatcmpl" if kind == "chat" else "cmpl"),
                            self.frontend.model_name, now(), self.frontend.decode_token,
                            params.logprobs)
            if req.stream:
                include_usage = bool((req.stream_options or {}).get("include_usage"))
                return await self._stream(routed, shaper, include_usage, param)
            return await self._whole(routed, shaper, param)
        except BackPressureError:  # raised where the handle call is made, not where it is read
            e = overloaded()
            self.frontend.metrics.observe_status(self.frontend.model_name, e.status)
            return _error_response(e)
        except ApiError as e:
            self.frontend.metrics.observe_status(self.frontend.model_name, e.status)
            return _error_response(e)

    async def _prompt_ids(self, req, kind: str) -> tuple[list[int], str]:
        if kind == "chat":
            return await self.frontend.encode_chat(chat_prompt_text(req.messages)), "messages"
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request (batches are not supported)",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.frontend.encode_text(prompt), "prompt"
        return list(prompt), "prompt"

    async def _whole(self, routed, shaper: Shaper, param: str):
        result = await collect(self.frontend.workers, routed)
        last = result.last
        if last is None or (last.finish_reason == "error" and not result.token_ids):
            raise self.frontend.worker_error(last, param) if last else ApiError(503, "no result")
        if last.finish_reason == "error":
            raise ApiError(503, last.error or "the request failed", type="server_error",
                           code="worker_failed", retry_after_s=1)
        self.frontend.account(routed, result.first_token_seen, last,
                              len(result.token_ids), 200)
        return shaper.full(result.text, result.token_ids, result.logprobs, result.top_logprobs,
                           last.finish_reason, last.num_prompt_tokens or routed.num_prompt_tokens,
                           last.num_cached_tokens)

    async def _stream(self, routed, shaper: Shaper, include_usage: bool, param: str):
        deltas = run_request(self.frontend.workers, routed)
        # The first delta comes before the response starts, so a request the worker refuses
        # still gets its 4xx status instead of an error inside a 200 stream.
        first = await deltas.__anext__()
        if first.finished and first.finish_reason == "error" and not first.token_ids:
            await deltas.aclose()
            raise self.frontend.worker_error(first, param)
        first_time = time.time()

        async def body():
            last, num_tokens, offset = first, 0, 0
            first_token_time = first_time if first.token_ids else None
            try:
                role = shaper.role_chunk(include_usage)
                if role is not None:
                    yield sse(role)
                delta = first
                while True:
                    num_tokens += len(delta.token_ids)
                    if delta.token_ids and first_token_time is None:
                        first_token_time = time.time()
                    yield sse(shaper.delta_chunk(delta.text, delta.token_ids, delta.logprobs,
                                                 delta.top_logprobs, delta.finish_reason, offset,
                                                 include_usage))
                    offset += len(delta.text)
                    last = delta
                    if delta.finished:
                        break
                    delta = await deltas.__anext__()
                if include_usage:
                    yield sse(shaper.usage_chunk(last.num_prompt_tokens or routed.num_prompt_tokens,
                                                 num_tokens, last.num_cached_tokens))
                yield SSE_DONE
                self.frontend.account(routed, first_token_time, last, num_tokens, 200)
            finally:
                await deltas.aclose()  # client gone: cancels the worker call (aborts there)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _auth(self, request: Request, endpoint: str = "api") -> JSONResponse | None:
        if self.api_keys.allows(endpoint, request.headers.get("authorization")):
            return None
        self.frontend.metrics.observe_status(self.frontend.model_name, 401)
        return JSONResponse(error_body(UNAUTHORIZED_MESSAGE, "authentication_error", None,
                                       "invalid_api_key"),
                            status_code=401, headers={"WWW-Authenticate": "Bearer"})
