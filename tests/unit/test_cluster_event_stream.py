"""The KV event stream of the cluster without Ray: workers publish into the EventLog, router copies
poll it into RoutingState (a real kvmesh.router.Router), late copies resync from snapshots, and a
just-routed prefix is preferred before its events arrive."""

from kvmesh.cluster.event_log import EventLog, WorkerGone
from kvmesh.cluster.recent_routes import RecentRoutes
from kvmesh.cluster.routing_state import RoutingState
from kvmesh.protocol import AllCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot, WorkerLoad


def stored(worker, seq, hashes, epoch=7):
    return KVEventBatch(worker, epoch, seq, [BlockStored(hashes, None, 16 * len(hashes))])


def test_log_applies_batches_in_order_and_asks_for_a_snapshot_on_a_gap():
    log = EventLog()
    assert log.publish(stored("a", 0, [1, 2]))
    assert log.publish(KVEventBatch("a", 7, 1, [BlockRemoved([1])]))
    assert log.snapshot("a") == KVSnapshot("a", 7, 1, [2], 16)
    assert not log.publish(stored("a", 3, [9]))  # seq 2 is missing
    assert log.publish(stored("a", 1, [5]))  # already covered: ignored
    log.publish_snapshot(KVSnapshot("a", 7, 3, [2, 9]))
    assert log.publish(KVEventBatch("a", 7, 4, [AllCleared()]))
    assert log.snapshot("a").block_hashes == []


def test_a_restarted_worker_starts_a_new_epoch_from_an_empty_cache():
    log = EventLog()
    log.publish(stored("a", 0, [1, 2]))
    assert not log.publish(stored("a", 5, [3], epoch=8))  # new epoch but not from its start
    assert log.publish(stored("a", 0, [3], epoch=8))
    assert log.snapshot("a") == KVSnapshot("a", 8, 0, [3], 16)


def test_poll_returns_entries_after_the_cursor_and_resyncs_a_stale_or_foreign_cursor():
    log = EventLog(max_entries=4)
    log.publish(stored("a", 0, [1]))
    first = log.poll(None, 0)
    assert first.resync and [s.worker_id for s in first.entries] == ["a"]
    log.publish(stored("a", 1, [2]))
    nxt = log.poll(first.instance, first.cursor)
    assert not nxt.resync and [e.seq for e in nxt.entries] == [1]
    for seq in range(2, 8):  # push the copy's cursor off the bounded log
        log.publish(stored("a", seq, [10 + seq]))
    late = log.poll(nxt.instance, nxt.cursor)
    assert late.resync and late.entries[0].block_hashes == sorted([1, 2] + [10 + s for s in range(2, 8)])
    assert log.poll("another-hub", late.cursor).resync


def test_removed_and_silent_workers_leave_the_stream():
    now = [0.0]
    log = EventLog(clock=lambda: now[0])
    log.publish(stored("a", 0, [1]))
    log.publish(stored("b", 0, [2]))
    cursor = log.head
    assert log.remove_worker("a")
    now[0] = 100.0
    log.update_load(WorkerLoad("b", running=1))
    assert log.remove_silent(30.0) == []
    now[0] = 200.0
    assert log.remove_silent(30.0) == ["b"]
    gone = log.poll(log.instance, cursor).entries
    assert [type(e) for e in gone] == [WorkerGone, WorkerGone]


def test_router_copies_route_a_cached_prefix_to_its_worker_and_late_copies_catch_up():
    log = EventLog()
    log.publish(stored("a", 0, []))
    log.publish(stored("b", 0, []))
    for w in ("a", "b"):
        log.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100))
    early = RoutingState("kv_events", 16, cap=8)
    early.apply(log.poll(None, 0))
    log.publish(stored("b", 1, [11, 12, 13, 14]))
    early.apply(log.poll(early.instance, early.cursor))
    late = RoutingState("kv_events", 16, cap=8)
    late.apply(log.poll(None, 0))  # a snapshot of both workers
    for state in (early, late):
        assert state.rank([11, 12, 13, 14, 15], 90, None, ["a", "b"])[0] == "b"


def test_round_robin_copies_alternate():
    state = RoutingState("round_robin", 16)
    picks = [state.rank([], 10, None, ["a", "b"])[0] for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_a_just_routed_prefix_goes_to_the_same_worker_before_its_events_arrive():
    state = RoutingState("kv_events", 16, cap=8)
    prompt = list(range(100, 120))
    first = state.rank(prompt, 330, None, ["a", "b"])[0]
    # the worker reports the first request prefilled (running) before its KV events arrive
    state.router.update_load(WorkerLoad(first, running=1, running_decode_tokens=331,
                                        kv_free_blocks=80, kv_total_blocks=100))
    second = state.rank(prompt[:18] + [7, 8], 330, None, ["a", "b"])[0]
    assert second == first


def test_a_follow_up_sent_before_any_new_report_goes_to_the_worker_computing_its_prefix():
    # No report between the two requests: this copy's own view of the first worker's queue still
    # holds the first request's prompt, which must not push its follow-up to the other worker.
    state = RoutingState("kv_events", 16, cap=8)
    for w in ("a", "b"):
        state.router.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100))
    prompt = list(range(100, 127))  # 27 blocks of 16 tokens: 429 tokens
    first = state.rank(prompt, 429, None, ["a", "b"])[0]
    second = state.rank(prompt[:26] + [7], 429, None, ["a", "b"])[0]
    assert second == first


def test_a_burst_between_load_reports_is_spread_by_the_load_it_adds():
    state = RoutingState("kv_events", 16, cap=8)
    for w in ("a", "b"):
        state.router.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100))
    picks = [state.rank([1000 + i], 300, None, ["a", "b"])[0] for i in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_recent_routes_expire_and_stop_at_a_different_worker():
    now = [0.0]
    recent = RecentRoutes(ttl_s=2.0, clock=lambda: now[0])
    recent.record([1, 2, 3], "a")
    recent.record([1, 2, 9], "b")  # the newer route of the shared blocks wins
    assert recent.match([1, 2, 3]) == ("b", 2)
    now[0] = 5.0
    assert recent.match([1, 2, 3]) == (None, 0)


def test_a_recent_route_does_not_override_the_load_balance_once_the_index_shows_the_prefix():
    # The recent-route preference bridges the moments before a prefix's KV events arrive. Once the
    # index shows the prefix on its worker, the policy's cost (which counts that cache hit against
    # the worker's load) decides alone: a worker busy decoding, with no prompt queued at its last
    # report, must not keep every request of its prefix.
    log = EventLog()
    prompt = list(range(100, 120))  # 20 blocks of 16 tokens
    log.publish(stored("a", 0, prompt))
    log.publish(stored("b", 0, []))
    for w in ("a", "b"):
        log.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100))
    state = RoutingState("kv_events", 16, cap=256)
    state.apply(log.poll(None, 0))
    assert state.rank(prompt, 320, None, ["a", "b"])[0] == "a"  # cached there (and now a recent route)
    log.update_load(WorkerLoad("a", running=60, running_decode_tokens=60 * 331,
                               kv_free_blocks=50, kv_total_blocks=100))
    state.apply(log.poll(state.instance, state.cursor))
    assert state.rank(prompt, 320, None, ["a", "b"])[0] == "b"
