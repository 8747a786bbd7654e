"""The ingress deployment: OpenAI-compatible HTTP (FastAPI on Serve's HTTP proxy) and the
kvmesh.v1.Generation gRPC service (Serve's gRPC proxy calls the methods named like the RPCs).

Each ingress replica holds a handle to the workers, so Serve gives it a copy of the KV-aware request
router (request_router.py). The HTTP routes here and the gRPC methods (grpc_service.py) are adapters
over one request pipeline (pipeline.py): they parse their wire request into its GenerationRequest
and render what it returns. Errors are OpenAI's error JSON with the right status; a client that
disconnects closes its stream, which aborts the request on the worker.
"""

import asyncio
import dataclasses
import functools
import json
import time

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from kvmesh.cluster import process_metrics
from kvmesh.cluster.auth import ApiKeys
from kvmesh.cluster.event_hub import get_or_create_hub
from kvmesh.cluster.frontend import Frontend
from kvmesh.cluster.grpc_service import GrpcService
from kvmesh.cluster.limits import RequestLimits
from kvmesh.cluster.pipeline import DeltaStream, GenerationRequest, Prompt, RequestPipeline
from kvmesh.cluster.status import cluster_health, worker_rows
from kvmesh.cluster.structured_request import parse_structured
from kvmesh.cluster.tool_calls import forced_structure, parse_tools, render_chat
from kvmesh.cluster import tool_parser
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
    headers = {}
    if e.retry_after_s:
        headers["Retry-After"] = str(int(e.retry_after_s))
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


def _max_tokens_param(req) -> str:
    return ("max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None
            else "max_tokens")


def _prompt(req, kind: str, tools=None, tokenizer=None) -> Prompt:
    if kind == "chat":
        messages, template_tools = render_chat(req.messages, chat_prompt_text(req.messages), tools,
                                               tokenizer)
        return Prompt("messages", messages=messages, tools=template_tools)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt per request (batches are not supported)",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return Prompt("prompt", text=prompt)
    return Prompt("prompt", token_ids=list(prompt))


def _sampling_params(req, structured, remaining_context: int):
    params = sampling_params(req, remaining_context)
    if structured is not None:
        params = dataclasses.replace(params, structured_outputs=structured.spec)
    return params


async def _sse(stream: DeltaStream, shaper: Shaper, include_usage: bool):
    """The SSE body of a stream; when the client goes, Starlette closes this generator and the
    stream with it (which aborts the request on the worker)."""
    async with stream:
        role = shaper.role_chunk(include_usage)
        if role is not None:
            yield sse(role)
        offset = 0
        async for delta in stream:
            yield sse(shaper.delta_chunk(delta.text, delta.token_ids, delta.logprobs,
                                         delta.top_logprobs, delta.finish_reason, offset,
                                         include_usage))
            offset += len(delta.text)
        if include_usage:
            last = stream.last
            yield sse(shaper.usage_chunk(last.num_prompt_tokens or stream.routed.num_prompt_tokens,
                                         stream.num_tokens, last.num_cached_tokens))
        yield SSE_DONE


async def _sse_tools(stream: DeltaStream, shaper: Shaper, include_usage: bool, tools):
    """The SSE body of a chat with tools: content and tool-call deltas (tool_parser.ToolStream)."""
    parser = tool_parser.ToolStream(tools)
    async with stream:
        yield sse(shaper.role_chunk(include_usage))
        async for delta in stream:
            pieces = parser.feed(delta.text)
            if delta.finished:
                pieces += parser.finish()
            for piece in pieces:
                yield sse(shaper.choice_chunk(piece, None, include_usage))
            if delta.finished:
                reason = tool_parser.finish_reason(delta.finish_reason, tools, parser.calls)
                yield sse(shaper.choice_chunk({}, reason, include_usage))
        if include_usage:
            last = stream.last
            yield sse(shaper.usage_chunk(last.num_prompt_tokens or stream.routed.num_prompt_tokens,
                                         stream.num_tokens, last.num_cached_tokens))
        yield SSE_DONE


# Module functions the routes call are defined above the class: Serve copies the class when
# `serve.ingress` decorates it, with the names the module holds at that point.
@serve.ingress(app)
class Ingress(GrpcService):
    def __init__(self, workers, config: dict):
        self.config = parse_config(config)
        self.frontend = Frontend(self.config, workers)
        self.hub = get_or_create_hub(self.config.app_name)
        self.api_keys = ApiKeys.from_server_config(self.config.server)
        self.limits = RequestLimits(self.config.limits)
        self.pipeline = RequestPipeline(self.frontend, self.limits, self.api_keys)
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
        health = cluster_health(loads, self.config.scales_to_zero)
        return JSONResponse(health.body(), status_code=health.http_status)

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
        try:
            self.pipeline.authorize("api", request.headers.get("authorization"))
            req = await self._parse(request, kind)
            structured = parse_structured(req)
            tools = parse_tools(req) if kind == "chat" else None
            if tools is not None and tools.parses_output and req.stream and req.logprobs:
                raise ApiError(400, "logprobs cannot be streamed with tools (tool-call deltas are "
                               "not token-aligned); ask without stream", param="logprobs")
            if tools is not None and (forced := forced_structure(tools)) is not None:
                if structured is not None:
                    raise ApiError(400, f"tool_choice {tools.choice} constrains the output; "
                                   f"{structured.param} cannot be given with it", param=structured.param)
                structured = forced
            if structured is not None:
                await self.frontend.check_grammar(structured.spec, structured.param)
            admitted = await self.pipeline.admit(GenerationRequest(
                _prompt(req, kind, tools, self.frontend.tokenizer),
                functools.partial(_sampling_params, req, structured),
                max_tokens=getattr(req, _max_tokens_param(req)),
                max_tokens_param=_max_tokens_param(req), model=req.model,
                session_key=request.headers.get(self.config.routing.session_header) or req.user,
                arrival=arrival))
            shaper = Shaper(kind, new_id("chatcmpl" if kind == "chat" else "cmpl"),
                            self.frontend.model_name, now(), self.frontend.decode_token,
                            admitted.routed.sampling_params.logprobs)
            if req.stream:
                include_usage = bool((req.stream_options or {}).get("include_usage"))
                stream = await self.pipeline.stream(admitted)
                body = (_sse(stream, shaper, include_usage) if tools is None
                        else _sse_tools(stream, shaper, include_usage, tools))
                return StreamingResponse(body,
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            result = await self.pipeline.whole(admitted)
            last = result.last
            body = shaper.full(result.text, result.token_ids, result.logprobs, result.top_logprobs,
                               last.finish_reason,
                               last.num_prompt_tokens or admitted.routed.num_prompt_tokens,
                               last.num_cached_tokens)
            if tools is not None and tools.parses_output:
                content, calls = tool_parser.parse_output(result.text, tools)
                choice = body["choices"][0]
                choice["message"]["content"] = content
                if calls:
                    choice["message"]["tool_calls"] = [c.body() for c in calls]
                choice["finish_reason"] = tool_parser.finish_reason(last.finish_reason, tools, calls)
            return body
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))

    async def _parse(self, request: Request, kind: str):
        try:
            body = json.loads(await self.limits.read_body(request))
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if (bad := lone_surrogate_path(body)) is not None:
            raise ApiError(400, f"{bad}: holds an unpaired UTF-16 surrogate (not valid "
                           "Unicode text)", param=bad)
        return parse_request(body, ChatCompletionRequest if kind == "chat" else CompletionRequest)

    def _auth(self, request: Request, endpoint: str = "api") -> JSONResponse | None:
        try:
            self.pipeline.authorize(endpoint, request.headers.get("authorization"))
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))
        return None

