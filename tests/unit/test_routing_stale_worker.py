"""A worker whose load reports stop (stalled, dying, SIGSTOPped) is ranked after the workers that
still report, within STALE_LOAD_S, even when it holds the request's whole prefix (regression: cache
affinity kept sending new requests to a stalled replica, where they waited until it resumed)."""

from kvmesh.cluster import routing_state
from kvmesh.cluster.event_log import EventLog
from kvmesh.cluster.routing_state import RoutingState
from kvmesh.hashing import block_hashes
from kvmesh.protocol import KVSnapshot, WorkerLoad

PROMPT = list(range(64))
HASHES = block_hashes(PROMPT, 16)


def test_a_worker_whose_load_stops_changing_is_ranked_last(monkeypatch):
    clock = {"now": 100.0}
    monkeypatch.setattr(routing_state.time, "monotonic", lambda: clock["now"])
    log = EventLog()
    log.publish_snapshot(KVSnapshot("holder", 1, 0, HASHES, 16))  # holds the whole prefix
    log.publish_snapshot(KVSnapshot("other", 1, 0, [], 16))
    state = RoutingState("kv_events", 16)

    def report(t, workers):
        for w in workers:
            log.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100, timestamp=t))
        state.apply(log.poll(state.instance, state.cursor))

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
