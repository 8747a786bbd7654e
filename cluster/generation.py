"""Running one request on the workers, with failover.

A worker replica that dies mid-request makes its handle stream raise (ActorDiedError and kin; Serve
does not retry); a replica whose engine died raises EngineUnavailable naming itself, and the next
attempt ranks that worker last. What happens next depends on what the client has seen:
- no token yet: the request is sent again (the router picks a live replica; the dead one left its
  replica set), up to MAX_ATTEMPTS times;
- tokens already streamed to the client: the stream ends with finish_reason "error";
- a non-streaming request has shown the client nothing, so it is always retried from the start
  (`restartable`; RESTART tells the collector to drop what it gathered).
Any other exception from a worker call ends the request with an error delta (logged, not retried),
so the ingress answers it as JSON: nothing from a worker escapes as a bare 500.
Closing the generator early (client gone) cancels the worker call, which aborts the request there.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import aclosing
from typing import Callable

import ray
from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id
from ray.serve.exceptions import BackPressureError

from kvmesh.cluster import router_copies
from kvmesh.cluster.engine_loop import EngineUnavailable
from kvmesh.cluster.messages import RoutedRequest
from kvmesh.cluster.metrics import TokenGaps
from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.protocol import TokenDelta

logger = logging.getLogger("kvmesh.cluster")

MAX_ATTEMPTS = 3
RESTART = object()  # yielded before a non-streaming request is run again on another replica
WORKER_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, EngineUnavailable)
OVERLOAD_RETRY_AFTER_S = 1


def overloaded() -> ApiError:
    return ApiError(429, "the server is overloaded: every worker replica is at its limit of "
                    "queued requests; retry later", type="server_error", code="overloaded",
                    retry_after_s=OVERLOAD_RETRY_AFTER_S)


def _worker_call(handle, routed: RoutedRequest, own_call_id: bool):
    """The worker call of one attempt. `own_call_id`: under a Serve request id of its own. Serve
    names a handle call after the request being served (`_internal_request_id`), and its router
    keeps calls waiting for a replica in a table by that name: two calls of one HTTP request made
    at once (several prompts) share it, and one of them is never answered (Ray 2.60,
    request_router.py `_pending_requests_by_id`). Cancelling still reaches such a call: the
    ingress cancels each itself (run_request), not through Serve's parent-request bookkeeping."""
    if not own_call_id:
        return handle.options(stream=True).generate.remote(routed)
    parent = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(
        dataclasses.replace(parent, _internal_request_id=generate_request_id()))
    try:  # the id is read when the call is made
        return handle.options(stream=True).generate.remote(routed)
    finally:
        serve_context._serve_request_context.reset(token)


def _error_delta(routed: RoutedRequest, message: str) -> TokenDelta:
    return TokenDelta(routed.request_id, [], "", finish_reason="error", error=message,
                      num_prompt_tokens=routed.num_prompt_tokens, arrival_time=routed.arrival_time)


async def run_request(handle, routed: RoutedRequest, restartable: bool = False,
                      on_retry: Callable[[], None] | None = None, own_call_id: bool = False):
    """Yield the request's TokenDeltas (the last one finished); see the module doc for failures.
    `on_retry` is called each time the request is sent again, however it ends. `own_call_id`: for
    a call made beside others of the same client request (_worker_call). The router copy that
    routed it hears of its end before the last delta is passed on (router_copies.request_ended)."""
    ended = False
    try:
        async with aclosing(_attempts(handle, routed, on_retry, own_call_id, restartable)) as deltas:
            async for delta in deltas:
                if delta is not RESTART and delta.finished:
                    # before the caller sees the end, so its next request is routed knowing it
                    router_copies.request_ended(routed.request_id, computed=delta.finish_reason != "error")
                    ended = True
                yield delta
    finally:
        if not ended:  # cut short (the client went away): out of its worker's load all the same
            router_copies.request_ended(routed.request_id, computed=False)


async def _attempts(handle, routed: RoutedRequest, on_retry, own_call_id: bool, restartable: bool):
    """run_request's deltas: the worker calls, retried as the module doc says."""
    last_error = None
    for attempt in range(MAX_ATTEMPTS):
        routed.attempt = attempt
        if attempt and on_retry is not None:
            on_retry()
        produced = False
        finished = False
        response = None
        try:
            response = _worker_call(handle, routed, own_call_id)
            async for delta in response:
                produced = produced or bool(delta.token_ids)
                finished = delta.finished
                yield delta
                if finished:
                    return
            yield _error_delta(routed, "the worker ended the stream without a finish")
            finished = True
            return
        except BackPressureError:
            raise overloaded() from None
        except WORKER_GONE as e:
            last_error = e
            logger.warning("kvmesh: worker died during request %s (attempt %d, tokens=%s): %r",
                           routed.request_id, attempt + 1, produced, e)
            if isinstance(e, EngineUnavailable):  # its replica lives on until Serve replaces it
                routed.avoid_workers.append(e.worker_id)
            if produced and not restartable:
                finished = True
                yield _error_delta(routed, f"the worker serving this request died: {type(e).__name__}")
                return
            if produced:
                yield RESTART
        except Exception as e:  # a failure of the worker's code, not of its process: not retried
            logger.exception("kvmesh: request %s failed on its worker", routed.request_id)
            finished = True
            yield _error_delta(routed, f"the worker failed: {type(e).__name__}")
            return
        finally:
            if not finished and response is not None:
                try:
                    response.cancel()
                except Exception:  # cancel() re-raises a failed call's error (BackPressureError)
                    pass           # over the ApiError being raised: keep ours
    yield _error_delta(routed, f"no worker could serve the request after {MAX_ATTEMPTS} attempts: "
                               f"{type(last_error).__name__}")


class Collected:
    """A whole (non-streaming) completion gathered from its deltas."""

    def __init__(self, per_sequence: bool = True):
        self.per_sequence = per_sequence  # also gather each sequence's deltas apart (n > 1)
        self.reset()

    def reset(self):
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict] = []
        self.last: TokenDelta | None = None
        self.prompt_logprobs = None  # PromptLogprobs, with SamplingParams.prompt_logprobs
        self.token_texts: dict[int, str] = {}  # TokenDelta.token_texts of every delta
        self.sequences: dict[int, Collected] = {}  # by TokenDelta.index (n > 1: one per choice)
        self.first_token_time: float | None = None  # the worker's clock
        self.first_token_seen: float | None = None  # when it reached the ingress
        self.token_gaps = TokenGaps() if self.per_sequence else None

    def add(self, delta: TokenDelta) -> None:
        self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.top_logprobs:
            self.top_logprobs.extend(delta.top_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.token_texts:
            self.token_texts.update(delta.token_texts)
        if self.per_sequence:
            sequence = self.sequences.get(delta.index)
            if sequence is None:
                sequence = self.sequences[delta.index] = Collected(per_sequence=False)
            sequence.add(delta)
        if self.token_gaps is not None:
            self.token_gaps.add(delta)
        if delta.first_token_time is not None and self.first_token_time is None:
            self.first_token_time = delta.first_token_time
        if delta.token_ids and self.first_token_seen is None:
            self.first_token_seen = time.time()
        self.last = delta

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


async def collect(handle, routed: RoutedRequest, on_retry: Callable[[], None] | None = None,
                  out: Collected | None = None, own_call_id: bool = False) -> Collected:
    """The whole completion; `out` (when given) holds what has come so far if this is cancelled."""
    out = out if out is not None else Collected()
    async for item in run_request(handle, routed, restartable=True, on_retry=on_retry,
                                  own_call_id=own_call_id):
        if item is RESTART:
            out.reset()
        else:
            out.add(item)
    return out
