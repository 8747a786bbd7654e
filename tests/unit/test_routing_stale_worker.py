"""A worker whose load reports stop (stalled, dying, SIGSTOPped) is ranked after the workers that
still report, within STALE_LOAD_S, even when it holds the request's whole prefix (regression: cache
affinity kept sending new requests to a stalled replica, where they waited until it resumed)."""

import pytest

from kvmesh.hashing import block_hashes, hash_array
from kvmesh.protocol import KVSnapshot, WorkerLoad
from kvmesh.router.event_log import EventLog
from kvmesh.router.routing_state import RoutingState

PROMPT = list(range(64))
HASHES = block_hashes(PROMPT, 16)


def _stale_setup(holder_hashes):
    """A holder of `holder_hashes` and an empty "other", a clock the test moves, and `report(t,
    workers, stalled=())` that sends those workers' loads stamped t (those in `stalled` saying their
    engine is stalled) and applies them."""
    clock = {"now": 100.0}
    log = EventLog()
    log.publish_snapshot(KVSnapshot("holder", 1, 0, holder_hashes, 16))
    log.publish_snapshot(KVSnapshot("other", 1, 0, [], 16))
    state = RoutingState("kv_events", 16, clock=lambda: clock["now"], stale_load_s=3.0)

    def report(t, workers, stalled=()):
        for w in workers:
            log.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100, timestamp=t,
                                       stalled=w in stalled))
        state.apply(log.poll(state.instance, state.cursor))

    return clock, state, report


def test_a_worker_whose_load_stops_changing_is_ranked_last():
    clock, state, report = _stale_setup(HASHES)  # the holder holds the whole prefix
    report(1.0, ["holder", "other"])
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"])[0] == "holder"
    # "other" keeps reporting, "holder" goes silent
    for i in range(2, 6):
        clock["now"] += 1.0
        report(float(i), ["other"])
    assert state.stale_workers() == {"holder"}
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"]) == ["other", "holder"]
    # it reports again: back in front for its cached prefix
    clock["now"] += 1.0
    report(9.0, ["holder", "other"])
    assert state.stale_workers() == set()
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"])[0] == "holder"


def test_a_worker_that_reports_its_engine_stalled_is_ranked_last_until_it_steps_again():
    """The replica's actor still reports (fresh heartbeats) while its engine process is frozen; the
    load's `stalled` flag ranks it last all the same."""
    log = EventLog()
    log.publish_snapshot(KVSnapshot("holder", 1, 0, HASHES, 16))
    log.publish_snapshot(KVSnapshot("other", 1, 0, [], 16))
    state = RoutingState("kv_events", 16)

    def report(t, stalled):
        log.update_load(WorkerLoad("holder", kv_free_blocks=100, kv_total_blocks=100, timestamp=t, stalled=stalled))
        log.update_load(WorkerLoad("other", kv_free_blocks=100, kv_total_blocks=100, timestamp=t))
        state.apply(log.poll(state.instance, state.cursor))

    report(1.0, stalled=True)
    assert state.stale_workers() == {"holder"}
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"]) == ["other", "holder"]
    report(2.0, stalled=False)
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"])[0] == "holder"


def test_a_worker_whose_engine_died_under_the_request_is_ranked_last_for_its_retry():
    """The retry of a request whose engine died is routed before every router copy has seen the
    death: the request names the worker to avoid."""
    log = EventLog()
    log.publish_snapshot(KVSnapshot("holder", 1, 0, HASHES, 16))
    log.publish_snapshot(KVSnapshot("other", 1, 0, [], 16))
    state = RoutingState("kv_events", 16)
    state.apply(log.poll(state.instance, state.cursor))
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"])[0] == "holder"
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"], avoid=["holder"]) == ["other", "holder"]


def test_with_silence_unmeasured_only_a_stalled_report_demotes():
    """A simulation's copies (stale_load_s=None): a worker whose reports stop changing is not
    demoted, one whose report says stalled still is."""
    log = EventLog()
    for w in ("holder", "other"):
        log.publish_snapshot(KVSnapshot(w, 1, 0, HASHES if w == "holder" else [], 16))
        log.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100, timestamp=1.0))
    state = RoutingState("kv_events", 16, clock=lambda: 1e6, stale_load_s=None)
    state.apply(log.poll(state.instance, state.cursor))
    assert state.stale_workers(now=2e6) == set()
    log.update_load(WorkerLoad("holder", kv_free_blocks=100, kv_total_blocks=100, timestamp=2.0,
                               stalled=True))
    state.apply(log.poll(state.instance, state.cursor))
    assert state.stale_workers(now=2e6) == {"holder"}


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_a_stale_limit_must_be_positive(bad):
    with pytest.raises(ValueError, match="stale_load_s must be > 0"):
        RoutingState("kv_events", 16, stale_load_s=bad)


@pytest.mark.parametrize("why", ["stale", "avoid", "not a candidate"])
def test_what_a_route_leaves_behind_lands_on_the_worker_really_first(why):
    """The request's count in a load (until the next report) and kv_events' record of the prefix
    in flight go to the worker the answer puts first, not to the holder it puts last."""
    clock, state, report = _stale_setup(HASHES[:2])  # half the prompt cached
    report(1.0, ["holder", "other"])
    candidates, avoid = ["holder", "other"], ()
    if why == "stale":
        for i in range(2, 6):
            clock["now"] += 1.0
            report(float(i), ["other"])
    elif why == "avoid":
        avoid = ("holder",)
    else:
        candidates = ["other"]
    order = state.rank(HASHES, len(PROMPT), None, candidates, avoid)
    assert order[0] == "other"
    loads = state.loads()
    assert (loads["other"].waiting, loads["holder"].waiting) == (1, 0)
    assert loads["other"].waiting_prefill_tokens == len(PROMPT)  # nothing of it cached there
    worker, blocks, computed = state.router.policy.pending.continuation(hash_array(HASHES), 0)
    assert worker == "other" and blocks == len(HASHES) and not computed
    assert state.router.workers.get("holder").healthy  # only out of that one choice


def test_without_keep_stale_a_stale_worker_is_left_out_while_another_can_serve():
    """The cluster's copies (keep_stale=False): Serve spills a request over to any later rank when
    the ones before are full, so a stale worker listed last still got requests whenever the others
    were at max_ongoing_requests, and they waited there for the stall. Left out, the request
    waits in Serve's queue for the others. Kept when nothing else could take it: every candidate
    stale, or the only other one to be avoided."""
    clock, state, report = _stale_setup(HASHES)
    report(1.0, ["holder", "other"])
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"], keep_stale=False)[0] == "holder"
    for i in range(2, 6):
        clock["now"] += 1.0
        report(float(i), ["other"])
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"]) == ["other", "holder"]
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"], keep_stale=False) == ["other"]
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"], avoid=["other"],
                      keep_stale=False) == ["holder", "other"]
    clock["now"] += 10.0  # both silent now
    assert state.stale_workers() == {"holder", "other"}
    assert sorted(state.rank(HASHES, len(PROMPT), None, ["holder", "other"], keep_stale=False)) == [
        "holder", "other"]
    report(20.0, ["holder"])  # it reports again: back, and in front for its cached prefix
    assert state.rank(HASHES, len(PROMPT), None, ["holder", "other"], keep_stale=False) == ["holder"]
