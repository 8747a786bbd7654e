"""The ingress deployment: OpenAI-compatible HTTP (FastAPI on Serve's HTTP proxy) and the
kvmesh.v1.Generation gRPC service (Serve's gRPC proxy calls the methods named like the RPCs).

Each ingress replica holds a handle to the workers, so Serve gives it a copy of the KV-aware request
router (request_router.py). The HTTP routes here and the gRPC methods (grpc_service.py) are adapters
over one request pipeline (pipeline.py): they parse their wire request into its GenerationRequest
and render what it returns. Errors are OpenAI's error JSON with the right status; a client that
disconnects closes its stream, which aborts the request on the worker. /v1/responses runs as the
chat it asks for (responses_api.py); its stored responses live in one actor shared by the replicas
(response_store.py), and a background response runs on in a task of the replica that took it.
"""

import asyncio
import contextvars
import functools
import logging
import json
import time

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from ray import serve

from kvmesh.cluster import process_metrics
from kvmesh.cluster.auth import ApiKeys, bearer_token
from kvmesh.cluster.event_hub import get_or_create_hub, hub_name
from kvmesh.cluster.frontend import Frontend
from kvmesh.cluster.grpc_health import HealthService
from kvmesh.cluster.grpc_service import GrpcService
from kvmesh.cluster.limits import RequestLimits
from kvmesh.cluster.pipeline import GenerationRequest, RequestPipeline
from kvmesh.cluster.shared_metrics import publish_forever
from kvmesh.cluster.status import HubLoads, cluster_health, worker_rows
from kvmesh.cluster.structured_request import parse_structured
from kvmesh.cluster.tool_calls import forced_structure, parse_tools, render_chat
from kvmesh.cluster import tool_parser
from kvmesh.cluster.reasoning import ChatReasoning
from kvmesh.cluster.text_checks import lone_surrogate_path
from kvmesh.cluster.openai_protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                            chat_prompt_text, error_body, new_id, now,
                                            parse_request, usage)
from kvmesh.cluster.openai_choices import StreamChoices, chosen_sequences, whole_body
from kvmesh.cluster.openai_echo import echo_for
from kvmesh.cluster.openai_request import (chat_echo_text, check_chat_template, max_tokens_param,
                                           prompts_of, response_role, sampling_params_with, session_key,
                                           template_options)
from kvmesh.cluster.openai_responses import Shaper
from kvmesh.cluster.openai_sse import SseResponse, sse_body, sse_tool_body
from kvmesh.cluster import responses_api
from kvmesh.cluster.response_store import get_or_create_store, owner_of
from kvmesh.cluster import tokenize_api
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


logger = logging.getLogger("kvmesh.cluster")
BACKGROUND_TOUCH_S = 1.0  # how often a background response tells the store it runs (and hears of a cancel)


def token_id_name(token_id: int) -> str:
    """A logprob token named by its id (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}"


def _store_unavailable(e: Exception) -> ApiError:
    return ApiError(503, f"the response store did not answer, so the response was not stored: {e!r}",
                    type="server_error", code="response_store_unavailable", retry_after_s=1)


def _not_stored(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"{param}: no stored response {response_id!r} (stored responses are kept in memory, "
                    "the oldest dropped beyond server.responses_store, and only for the API key that stored them)",
                    param=param, code="response_not_found")


def _combined(bodies: list[dict]) -> dict:
    """One response of several prompts' bodies: their choices in order, renumbered (prompt i's
    choice j is i * n + j, as vLLM numbers them), their usage summed."""
    body = bodies[0]
    if len(bodies) == 1:
        return body
    body["choices"] = [choice for b in bodies for choice in b["choices"]]
    for index, choice in enumerate(body["choices"]):
        choice["index"] = index
    body["usage"] = usage(sum(b["usage"]["prompt_tokens"] for b in bodies),
                          sum(b["usage"]["completion_tokens"] for b in bodies),
                          sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies))
    return body


# Module functions the routes call are defined above the class: Serve copies the class when
# `serve.ingress` decorates it, with the names the module holds at that point.
@serve.ingress(app)
class Ingress(GrpcService, HealthService):
    def __init__(self, workers, config: dict):
        self.config = parse_config(config)
        self.frontend = Frontend(self.config, workers)
        by_name = functools.partial(get_or_create_hub, self.config.app_name)
        self.hub_loads = HubLoads(by_name, hub_name(self.config.app_name), hub=by_name())
        self.api_keys = ApiKeys.from_server_config(self.config.server)
        self.limits = RequestLimits(self.config.limits)
        self.pipeline = RequestPipeline(self.frontend, self.limits, self.api_keys)
        # /v1/responses' store (server.responses_store; None: off), one actor for every replica
        self.stored_responses = (get_or_create_store(self.config.app_name)
                                 if self.config.server.responses_store else None)
        self._background: set[asyncio.Task] = set()  # background responses running here
        self.created = int(time.time())  # the model cards' `created`: when this replica started
        process_metrics.register(self.frontend.metrics.registry)
        self._metrics_publisher = asyncio.get_running_loop().create_task(publish_forever(
            self.frontend.metrics, serve.get_replica_context().replica_id.unique_id, by_name))
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
        answer = await self.hub_loads.get()  # None: the hub did not answer in time
        health = cluster_health(answer and answer[0], self.config.scales_to_zero)
        return JSONResponse(health.body(), status_code=health.http_status)

    @app.get("/v1/models")
    async def models(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        try:
            return {"object": "list", "data": [await self._model_card()]}
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        """OpenAI's retrieve: the served model's card under its name or an alias, else 404."""
        if (denied := self._auth(request)) is not None:
            return denied
        try:
            self.frontend.check_model(model_id, required=True)
            return await self._model_card()
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))

    async def _model_card(self) -> dict:
        info = await self.frontend.model_info()
        return {"id": self.frontend.model_name, "object": "model", "created": self.created,
                "owned_by": "kvmesh", "max_model_len": info.max_model_len, "vocab_size": info.vocab_size}

    @app.get("/version")
    async def version(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        from kvmesh import __version__

        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a prompt or chat messages, tokenized as the generation endpoints do."""
        try:
            req = await self._tokenizer_request(request, tokenize_api.TokenizeCompletion)
            if isinstance(req, tokenize_api.TokenizeChat):  # rendered as chat renders it
                check_chat_template(req, self.config.server.trust_request_chat_template)
                messages, _ = render_chat(req.messages, chat_prompt_text(req.messages), None,
                                          self.frontend.tokenizer)
                ids = await self.frontend.encode_chat(
                    messages, None, template_options(req, self.frontend.tokenizer, messages))
            else:
                ids = await self.frontend.encode_text(req.prompt, req.add_special_tokens)
            info = await self.frontend.model_info()
            strs = (self.frontend.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs
                    else None)
            return tokenize_api.tokenize_response(ids, info.max_model_len, strs)
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's /detokenize: token ids -> {"prompt": text}."""
        try:
            req = await self._tokenizer_request(request, tokenize_api.Detokenize)
            info = await self.frontend.model_info()
            vocab = info.vocab_size or len(self.frontend.tokenizer)
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"tokens must be token ids in [0, {vocab}), got {bad[0]}",
                               param="tokens")
            return {"prompt": await self.frontend.decode(req.tokens)}
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))

    @app.get("/v1/kvmesh/workers")
    async def workers(self, request: Request):
        """Per-worker load, KV usage and prefix hit rate (what `kvmesh status` prints); a 503
        naming the KV event hub when it does not answer in time (cluster/status.py HubLoads)."""
        if (denied := self._auth(request)) is not None:
            return denied
        answer = await self.hub_loads.get()
        if answer is None:  # not counted in kvmesh_requests_total: not an API request
            return _error_response(ApiError(503, self.hub_loads.unavailable_message(),
                                            type="server_error", code="kv_event_hub_unavailable",
                                            retry_after_s=1))
        return {"model": self.frontend.model_name, "workers": worker_rows(*answer)}

    @app.get("/metrics")
    async def metrics(self, request: Request):
        if (denied := self._auth(request, "metrics")) is not None:
            return denied
        answer = await self.hub_loads.get()  # None: the hub did not answer; a scrape still does
        loads, stats = answer or ({}, {})
        return Response(self.frontend.metrics.render(loads, stats, hub_up=answer is not None),
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

    @app.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI's Responses API (text and function tools), run as the chat it asks for
        (cluster/responses_api.py)."""
        return await self._complete(request, "responses")

    @app.get("/v1/responses/{response_id}")
    async def stored_response(self, response_id: str, request: Request):
        """A response stored by the same API key (server.responses_store), else 404."""
        try:
            self.pipeline.authorize("api", request.headers.get("authorization"))
            self._no_query(request)
            found = await self._stored(response_id, self._owner(request), "response_id")
            return found[0]
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request):
        try:
            self.pipeline.authorize("api", request.headers.get("authorization"))
            self._no_query(request)
            self._store_on("response_id")
            if not await self.stored_responses.delete.remote(response_id, self._owner(request)):
                raise _not_stored(response_id, "response_id")
            return {"id": response_id, "object": "response", "deleted": True}
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request):
        """OpenAI's list of a stored response's input items (the conversation it continued and its
        input), paged by `limit`, `order` and `after`."""
        try:
            self.pipeline.authorize("api", request.headers.get("authorization"))
            query = request.query_params
            self._no_query(request, ("limit", "order", "after"))
            self._store_on("response_id")
            items = await self.stored_responses.inputs.remote(response_id, self._owner(request))
            if items is None:
                raise _not_stored(response_id, "response_id")
            return responses_api.item_page(items, query.get("limit"), query.get("order"), query.get("after"))
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request):
        """Cancel a background response: its generation stops (aborted on the worker within
        BACKGROUND_TOUCH_S) and it stays stored as cancelled; one that had ended is returned as is."""
        try:
            self.pipeline.authorize("api", request.headers.get("authorization"))
            self._no_query(request)
            self._store_on("response_id")
            found = await self.stored_responses.cancel.remote(response_id, self._owner(request))
            if found is None:
                raise _not_stored(response_id, "response_id")
            if found == "not_background":
                raise ApiError(400, f"response_id: {response_id!r} was not created with background: true; "
                               "only a background response can be cancelled", param="response_id")
            return found
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))

    def _owner(self, request: Request) -> str:
        """Whose stored responses a request reaches: its API key's (everyone's without keys)."""
        if not self.api_keys.enabled:
            return ""
        return owner_of(bearer_token(request.headers.get("authorization")))

    def _store_on(self, param: str) -> None:
        if self.stored_responses is None:
            raise ApiError(404, f"{param}: responses are not stored on this server "
                           "(server.responses_store is 0)", param=param)

    @staticmethod
    def _no_query(request: Request, allowed: tuple[str, ...] = ()) -> None:
        """400 naming a query parameter the route does not take."""
        for name in request.query_params:
            if name not in allowed:
                known = f" ({', '.join(allowed)})" if allowed else ""
                raise ApiError(400, f"{name}: not a query parameter here{known}", param=name)

    async def _stored(self, response_id: str, owner: str, param: str) -> tuple[dict, list]:
        """(response, conversation) of a stored response of `owner`; 404 naming `param` if none."""
        self._store_on(param)
        found = await self.stored_responses.get.remote(response_id, owner)
        if found is None:
            raise _not_stored(response_id, param)
        return found

    async def _keep(self, shaper, owner: str, response: dict, background: bool = False) -> None:
        """Store a finished response, or a background one as it starts, with its input items."""
        await self.stored_responses.put.remote(response, shaper.inputs, owner,
                                               self.config.server.responses_store, background)

    async def _complete(self, request: Request, kind: str):
        arrival = time.time()
        responses = None  # a Responses request: its shaper, and errors named in its fields
        keep = None  # a Responses request to store: awaited with its finished response
        try:
            self.pipeline.authorize("api", request.headers.get("authorization"))
            if kind == "responses":
                raw = await self._json(request)
                earlier, owner = None, self._owner(request)
                previous = raw.get("previous_response_id") if isinstance(raw, dict) else None
                if previous is not None and self.stored_responses is not None:
                    if not isinstance(previous, str):
                        raise ApiError(400, "previous_response_id: a string", param="previous_response_id")
                    earlier = (await self._stored(previous, owner, "previous_response_id"))[1]
                    if earlier is None:
                        raise ApiError(400, f"previous_response_id: {previous!r} did not finish (a background "
                                       "response still running, or one cancelled or failed)",
                                       param="previous_response_id")
                responses = responses_api.ResponseShaper(raw, self.frontend.model_name, now(), earlier)
                req, kind = parse_request(responses_api.chat_body(raw, earlier, self.stored_responses is not None),
                                          ChatCompletionRequest), "chat"
                if responses.stored:
                    keep = functools.partial(self._keep, responses, owner)
            else:
                req = await self._parse(request, kind)
            check_chat_template(req, self.config.server.trust_request_chat_template)
            structured = parse_structured(req)
            tools = parse_tools(req) if kind == "chat" else None
            if tools is not None and tools.parses_output and req.stream and req.logprobs:
                raise ApiError(400, "logprobs cannot be streamed with tools (tool-call deltas are "
                               "not token-aligned); ask without stream", param="logprobs")
            if tools is not None and tools.parses_output and req.stream and req.return_token_ids:
                raise ApiError(400, "return_token_ids cannot be streamed with tools (tool-call deltas "
                               "are not token-aligned); ask without stream", param="return_token_ids")
            if tools is not None and tools.parses_output and req.echo:
                raise ApiError(400, "echo cannot be given with tools the model may call (tool_choice "
                               "none allows it)", param="echo")
            if tools is not None and (forced := forced_structure(tools)) is not None:
                if structured is not None:
                    raise ApiError(400, f"tool_choice {tools.choice} constrains the output; "
                                   f"{structured.param} cannot be given with it", param=structured.param)
                structured = forced
            if structured is not None:
                await self.frontend.check_grammar(structured.spec, structured.param)
            prompts = prompts_of(req, kind, tools, self.frontend.tokenizer)
            admitted = [await self.pipeline.admit(GenerationRequest(
                prompt, functools.partial(sampling_params_with, req, structured),
                max_tokens=getattr(req, max_tokens_param(req)),
                max_tokens_param=max_tokens_param(req), model=req.model,
                session_key=session_key(request, self.config.routing.session_header, req),
                arrival=arrival, cache_salt=req.cache_salt, priority=req.priority)) for prompt in prompts]
            token_decode = token_id_name if req.return_tokens_as_token_ids else self.frontend.decode_token
            shaper = Shaper(kind, new_id("chatcmpl" if kind == "chat" else "cmpl"),
                            self.frontend.model_name, now(), token_decode,
                            admitted[0].routed.sampling_params.logprobs)
            shaper.return_token_ids = bool(req.return_token_ids)
            if kind == "chat":
                shaper.role = response_role(req)
            reasoning = (ChatReasoning(self.frontend.reasoning, admitted[0].routed.prompt_token_ids,
                                       req.include_reasoning)
                         if kind == "chat" and self.frontend.reasoning is not None else None)
            echoes = [echo_for(req, kind, chat_echo_text(req) if kind == "chat" else prompt.text,
                               one.routed.prompt_token_ids, self.frontend, token_decode)
                      for prompt, one in zip(prompts, admitted)]
            if req.stream:
                options = req.stream_options or {}
                include_usage = bool(options.get("include_usage"))
                if len(admitted) == 1:
                    streams = [await self.pipeline.stream(admitted[0])]
                else:  # started at once, as vLLM runs them
                    streams = await self.pipeline.streams_of_several(admitted)
                if responses is not None:  # one prompt, one choice
                    body = responses_api.sse_events(streams[0], responses, tools, shaper.logprob_entries, keep,
                                                    reasoning)
                elif tools is not None:  # chat: one prompt
                    body = sse_tool_body(streams[0], shaper, include_usage, tools, req.n, reasoning)
                else:
                    choices = [StreamChoices(shaper, include_usage, echo, req.n, index_base=i * req.n,
                                             prompt_ids=one.routed.prompt_token_ids, reasoning=reasoning)
                               for i, (echo, one) in enumerate(zip(echoes, admitted))]
                    body = sse_body(streams, choices, shaper, include_usage,
                                bool(options.get("continuous_usage_stats")))
                return SseResponse(streams, body, media_type="text/event-stream",
                                   headers={"Cache-Control": "no-cache"})
            whole = functools.partial(self._whole, kind, admitted, shaper, echoes, tools, reasoning)
            if responses is not None and responses.background:
                return await self._start_in_background(responses, whole, keep)
            body = await whole()
            if responses is not None:
                answer = responses_api.response_body(responses, body)
                if keep is not None:
                    try:
                        await keep(answer)
                    except Exception as e:
                        raise _store_unavailable(e) from None
                return answer
            return body
        except ApiError as e:
            if responses is not None:
                e = responses_api.in_responses_terms(e, responses.body, responses.earlier)
            return _error_response(self.pipeline.refused(e))

    async def _whole(self, kind: str, admitted: list, shaper: Shaper, echoes: list, tools,
                     reasoning: ChatReasoning | None = None) -> dict:
        """The body of a non-streaming request's admitted prompts, run to their ends. A chat's
        answer is split into reasoning and content first (server.reasoning_parser), then its
        content read for tool calls."""
        if len(admitted) == 1:
            results = [await self.pipeline.whole(admitted[0])]
        else:
            results = await self.pipeline.whole_of_several(admitted)
        body = _combined([
            whole_body(shaper, result, one.routed.sampling_params, kind, echo,
                       result.last.num_prompt_tokens or one.routed.num_prompt_tokens,
                       result.last.num_cached_tokens, one.routed.prompt_token_ids)
            for one, result, echo in zip(admitted, results, echoes)])
        parses_tools = tools is not None and tools.parses_output
        if reasoning is None and not parses_tools:
            return body
        sequences = chosen_sequences(results[0], admitted[0].routed.sampling_params)
        echoed = echoes[0].prompt_text if echoes[0] is not None and echoes[0].echo else ""
        for choice, sequence in zip(body["choices"], sequences):  # each choice parsed on its own
            message, text = choice["message"], sequence.text
            if reasoning is not None:  # tools are read from the content only (as vLLM)
                message["reasoning"], text = reasoning.whole(text)
                text = text or ""
                message["content"] = (echoed + text) or None
            if parses_tools:
                content, calls = tool_parser.parse_output(text, tools)
                message["content"] = content
                if calls:
                    message["tool_calls"] = [c.body() for c in calls]
                choice["finish_reason"] = tool_parser.finish_reason(
                    sequence.last.finish_reason if sequence.last is not None else None,
                    tools, calls)
        return body

    async def _start_in_background(self, shaper, whole, keep) -> dict:
        """A `background: true` response: stored as queued and answered at once; it runs on in a
        task of this replica (out of the HTTP request's context, so the client's going does not
        cancel it), which tells the store every BACKGROUND_TOUCH_S that it runs and stops when the
        store says it was cancelled, deleted or dropped, and stores its end (failed on an error)."""
        queued = shaper.response("queued", [])
        try:
            await keep(queued, background=True)
        except Exception as e:
            raise _store_unavailable(e) from None
        task = asyncio.get_running_loop().create_task(self._run_in_background(shaper, whole),
                                                      context=contextvars.Context())
        self._background.add(task)  # held until it ends (the loop keeps only weak references)
        task.add_done_callback(self._background.discard)
        return queued

    async def _run_in_background(self, shaper, whole) -> None:
        store, response_id = self.stored_responses, shaper.id
        work = asyncio.ensure_future(whole())
        try:
            stop = await store.touch.remote(response_id, shaper.response("in_progress", []))
            while not stop:
                done, _ = await asyncio.wait({work}, timeout=BACKGROUND_TOUCH_S)
                if done:
                    break
                stop = await store.touch.remote(response_id)
            if stop:  # cancelled (the store holds it as such), deleted or dropped
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                return
            try:
                answer = responses_api.response_body(shaper, work.result())
            except ApiError as e:
                e = responses_api.in_responses_terms(e, shaper.body, shaper.earlier)
                answer = shaper.response("failed", [], error={"code": e.code or "server_error",
                                                              "message": e.message})
            await store.finish.remote(answer)
        except Exception:  # the store is gone: nothing to tell
            logger.warning("kvmesh: background response %s ended without being stored", response_id,
                           exc_info=True)
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)

    async def _parse(self, request: Request, kind: str):
        return parse_request(await self._json(request),
                             ChatCompletionRequest if kind == "chat" else CompletionRequest)

    async def _tokenizer_request(self, request: Request, cls):
        """The body of an authorized /tokenize or /detokenize request as `cls`, for the served model."""
        self.pipeline.authorize("api", request.headers.get("authorization"))
        req = tokenize_api.parse(await self._json(request), cls)
        self.frontend.check_model(req.model)
        return req

    async def _json(self, request: Request):
        try:
            body = json.loads(await self.limits.read_body(request))
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if (bad := lone_surrogate_path(body)) is not None:
            raise ApiError(400, f"{bad}: holds an unpaired UTF-16 surrogate (not valid "
                           "Unicode text)", param=bad)
        return body

    def _auth(self, request: Request, endpoint: str = "api") -> JSONResponse | None:
        try:
            self.pipeline.authorize(endpoint, request.headers.get("authorization"))
        except ApiError as e:
            return _error_response(self.pipeline.refused(e))
        return None

