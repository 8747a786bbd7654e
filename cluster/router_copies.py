"""The router copies of this process (each ingress replica holds one per handle to the workers:
cluster/request_router.py), and what the ingress tells them.

Serve pickles the request router's module by value, so that module's own globals are a private copy
in the replica; this module is imported by reference, so the copies register here
(`KVAwareRequestRouter.initialize_state`) and the ingress (cluster/generation.py) and the metrics
collector (cluster/process_metrics.py) find them.
"""

from __future__ import annotations

ROUTER_COPIES: list = []


def track(copy) -> None:
    ROUTER_COPIES.append(copy)


def request_ended(request_id: str, computed: bool) -> None:
    """The ingress has the last output of the request routed under `request_id` (`computed`: it
    finished; False: it failed or was cut short): the copy that routed it takes it out of its
    worker's load and, if computed, credits that worker with its prompt (RoutingState.finished).
    Called before the last output is passed on, so the caller's next request is routed knowing it:
    a copy running on an event loop of its own (Serve's router thread) gets it as a callback on that
    loop, queued ahead of the next request's routing and never waiting on the copy's lock in the
    ingress's loop; one without (a test's) at once."""
    for copy in list(ROUTER_COPIES):
        state = getattr(copy, "state", None)
        if state is None:
            continue
        loop = getattr(copy, "loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(state.finished, request_id, computed)
        elif state.finished(request_id, computed):
            return
