"""A router copy hears when a request it routed ends (RoutingState.finished, called by the ingress
through cluster/router_copies.py before the last output is passed on): the request leaves its
worker's load, and kv_events credits that worker with the prompt as cached until the index shows it.
Regression: a request sent right after an answer that shared its long prefix went to the other
replica whenever the copy had not yet polled the first worker's events (docs/ROUTING.md "Router copies")."""

import asyncio

import pytest

from kvmesh.cluster import router_copies
from kvmesh.cluster.generation import run_request
from kvmesh.cluster.messages import RoutedRequest
from kvmesh.hashing import block_hashes, hash_array
from kvmesh.protocol import KVSnapshot, TokenDelta, WorkerLoad
from kvmesh.router.event_log import EventLog
from kvmesh.router.pending import PendingPrefixes
from kvmesh.router.routing_state import RoutingState
from kvmesh.router.workers import WorkerSet
from kvmesh.sampling_params import SamplingParams
from handle_support import Handle

B = 16
SHARED = list(range(400))  # a long shared prefix: 25 blocks
FIRST, SECOND = SHARED + [9001] * 30, SHARED + [9002] * 30


def idle_pair(**reported) -> RoutingState:
    """Two workers, "a" and "b", known to the copy with empty caches and fresh loads: idle, or as
    `reported` gives a worker's load fields (a=dict(waiting=1, ...))."""
    log = EventLog()
    for w in ("a", "b"):
        log.publish_snapshot(KVSnapshot(w, 1, 0, [], B))
        log.update_load(WorkerLoad(w, kv_free_blocks=1000, kv_total_blocks=1000, timestamp=1.0,
                                   **reported.get(w, {})))
    state = RoutingState("kv_events", B, stale_load_s=None)
    state.apply(log.poll(state.instance, state.cursor))
    return state


def route(state, prompt, request_id=None):
    return state.rank(block_hashes(prompt, B), len(prompt), None, ["a", "b"], request_id=request_id)[0]


def test_a_request_sent_after_the_answer_goes_where_its_prefix_was_computed():
    state = idle_pair()
    first = route(state, FIRST, "r1")
    assert state.loads()[first].waiting == 1  # counted until the worker's next report
    assert state.finished("r1")
    load = state.loads()[first]
    assert (load.waiting, load.waiting_prefill_tokens) == (0, 0)
    # the copy has heard none of the worker's events: only the request's end says it holds the prefix
    assert state.router.index.overlap(hash_array(block_hashes(SECOND, B))) == {}
    assert route(state, SECOND) == first
    assert not state.finished("r1"), "each end is heard once"


def test_without_its_end_the_second_request_goes_to_the_other_worker():
    """What the end changes: the first worker still counts the first request and is only credited
    with a copy saved for the prefix it may still be computing, so the idle one is cheaper."""
    state = idle_pair()
    first = route(state, FIRST, "r1")
    assert route(state, SECOND) != first


def test_a_failed_request_leaves_the_load_without_a_credit():
    state = idle_pair()
    first = route(state, FIRST, "r1")
    assert state.finished("r1", computed=False)
    assert state.loads()[first].waiting == 0
    _, _, computed = state.router.policy.pending.continuation(hash_array(block_hashes(SECOND, B)), 0)
    assert not computed


@pytest.mark.parametrize("end", ["computed", "failed", "still running"])
def test_a_finished_prefix_is_credited_at_the_prefill_weight_not_the_in_flight_one(end):
    """ROUTING.md: once the request finished, its worker is credited with its prefix as cached,
    `weights.prefill` (2.0) a token, not `weights.in_flight` (1.0). Worker "a" reports one waiting
    request of 400 prompt tokens; the follow-up (430 tokens, 400 of them the first request's) costs
    860 on idle "b", and on "a" 860 + 400 queued + 256 outstanding less the credit for 400 tokens:
    316 + 400 with the prefill weight (a), 716 + 400 with the in-flight weight (b)."""
    state = idle_pair(a=dict(waiting=1, waiting_prefill_tokens=400))
    assert state.rank(block_hashes(FIRST, B), len(FIRST), None, ["a"], request_id="r1")[0] == "a"
    if end != "still running":
        assert state.finished("r1", computed=end == "computed")
    assert route(state, SECOND) == ("a" if end == "computed" else "b")


def test_a_report_after_the_route_already_holds_the_request():
    workers = WorkerSet()
    workers.add("a")
    workers.add_routed("a", 100, "r1")
    assert workers.get("a").load.waiting == 1
    workers.update_load(WorkerLoad("a", waiting=1, waiting_prefill_tokens=100, timestamp=2.0))
    assert not workers.remove_routed("a", "r1")  # the report counts it now: left as reported
    assert (workers.get("a").load.waiting, workers.get("a").load.waiting_prefill_tokens) == (1, 100)
    assert not workers.remove_routed("nobody", "r1")


def test_only_the_record_of_that_request_is_marked_computed():
    hashes = hash_array(block_hashes(FIRST, B))
    same_start = hash_array(block_hashes(FIRST, B))  # equal hashes, another request
    pending = PendingPrefixes()
    pending.record(hashes, 0, "a")
    assert not pending.mark_computed(same_start, "a")  # not the object recorded
    assert not pending.mark_computed(hashes, "b")  # not where it was sent
    assert pending.mark_computed(hashes, "a")
    assert pending.continuation(hashes, 0) == ("a", len(hashes), True)
    pending.record(same_start, 0, "b")  # a later request from the same start replaces it
    assert pending.continuation(hashes, 0) == ("b", len(hashes), False)


class Copy:
    """What router_copies holds: the ingress's request router, with its RoutingState (no event loop
    of its own: router_copies calls it at once)."""

    def __init__(self, state):
        self.state = state


@pytest.fixture
def registered():
    """An idle pair's RoutingState, registered as this process's router copy for the test."""
    copy = Copy(idle_pair())
    router_copies.ROUTER_COPIES.append(copy)
    yield copy.state
    router_copies.ROUTER_COPIES.remove(copy)


def test_the_ingress_reports_the_end_before_passing_the_last_output_on(registered):
    state = registered
    request = RoutedRequest("r1", FIRST, SamplingParams(max_tokens=2), block_hashes=block_hashes(FIRST, B))
    worker = route(state, FIRST, "r1")
    seen = []

    async def main():
        handle = Handle([TokenDelta("r1", [5], "x"), TokenDelta("r1", [6], "y", finish_reason="length")])
        async for delta in run_request(handle, request):
            seen.append((delta.finished, state.loads()[worker].waiting))
    asyncio.run(main())
    assert seen == [(False, 1), (True, 0)]
    assert route(state, SECOND) == worker


def test_a_stream_cut_short_takes_the_request_out_of_the_load(registered):
    state = registered
    request = RoutedRequest("r1", FIRST, SamplingParams(max_tokens=8), block_hashes=block_hashes(FIRST, B))
    worker = route(state, FIRST, "r1")

    async def main():
        handle = Handle([TokenDelta("r1", [5], "x"), asyncio.Event()])
        deltas = run_request(handle, request)
        await deltas.__anext__()
        await deltas.aclose()  # the client went away
        return handle.responses[0].cancelled
    assert asyncio.run(main()), "the worker call is cancelled"
    assert state.loads()[worker].waiting == 0
    _, _, computed = state.router.policy.pending.continuation(hash_array(block_hashes(SECOND, B)), 0)
    assert not computed


def test_a_copy_remembers_the_last_4096_requests_it_routed(monkeypatch):
    # ROUTING.md: the oldest unheard-of request is forgotten beyond 4,096 (a bounded memory)
    from kvmesh.router import routing_state

    assert routing_state.MAX_ROUTED_REQUESTS == 4096
    monkeypatch.setattr(routing_state, "MAX_ROUTED_REQUESTS", 3)
    state = idle_pair()
    for i in range(5):
        route(state, [i] * 20, request_id=f"r{i}")
    assert [state.finished(f"r{i}") for i in range(5)] == [False, False, True, True, True]
