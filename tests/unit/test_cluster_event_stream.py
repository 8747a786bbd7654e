"""The KV event stream of the cluster without Ray: workers publish into the EventLog, router copies
poll it into RoutingState (a real kvmesh.router.Router), late copies resync from snapshots, and a
just-routed prefix is preferred before its events arrive (the kv_events policy's record of prefixes
in flight, router/pending.py, the one such mechanism)."""

import pytest

from kvmesh.protocol import AllCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot, WorkerLoad
from kvmesh.router.event_log import EventLog, WorkerGone
from kvmesh.router.routing_state import RoutingState


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
    # The kv_events policy credits the worker computing a shared prefix for an earlier request
    # (1 per shared token in flight): here that credit (38 blocks, 608 tokens) outweighs the load
    # the first request put there (one running request: ~309), and nothing else does.
    state = RoutingState("kv_events", 16, cap=8)
    prompt = list(range(100, 140))  # 40 blocks
    first = state.rank(prompt, 650, None, ["a", "b"])[0]
    # the worker reports the first request prefilled (running) before its KV events arrive
    state.router.update_load(WorkerLoad(first, running=1, running_decode_tokens=651,
                                        kv_free_blocks=80, kv_total_blocks=100))
    second = state.rank(prompt[:38] + [7, 8], 650, None, ["a", "b"])[0]
    assert second == first


def test_a_follow_up_sent_before_any_new_report_goes_to_the_worker_computing_its_prefix():
    # No report between the two requests: this copy's own count of the first worker's queue holds
    # the first request's prompt (429 tokens, one waiting request). The other worker reported a
    # smaller queue (200 tokens, one waiting), so on load alone the follow-up would go there; the
    # 416 tokens in flight on the first worker bring it back.
    state = RoutingState("kv_events", 16, cap=8)
    state.router.update_load(WorkerLoad("a", kv_free_blocks=100, kv_total_blocks=100))
    state.router.update_load(WorkerLoad("b", waiting=1, waiting_prefill_tokens=200,
                                        kv_free_blocks=100, kv_total_blocks=100))
    prompt = list(range(100, 127))  # 27 blocks of 16 tokens: 429 tokens
    assert state.rank(prompt, 429, None, ["a", "b"])[0] == "a"
    assert state.loads()["a"].waiting_prefill_tokens == 429  # counted by the copy until a report
    assert state.rank(prompt[:26] + [7], 429, None, ["a", "b"])[0] == "a"


@pytest.mark.parametrize("published", [True, False])
def test_a_copy_s_count_of_what_it_routed_lasts_until_its_next_poll_of_the_hub(published):
    """ROUTING.md: the copy's next poll carries every worker's latest report and re-applies it, so
    the count lasts until the poll returns (another worker's publication, or the long poll's
    timeout with nothing new), not until the routed worker's next report."""
    log = EventLog()
    for w in ("a", "b"):
        log.publish(stored(w, 0, []))
        log.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100, timestamp=1.0))
    state = RoutingState("least_loaded", 16)
    state.apply(log.poll(None, 0))
    picked = state.rank(list(range(100, 127)), 429, None, ["a", "b"])[0]
    assert state.loads()[picked].waiting == 1  # this copy's own count
    if published:  # only the other worker publishes
        log.publish(stored("b" if picked == "a" else "a", 1, [5]))
    state.apply(log.poll(state.instance, state.cursor))
    assert state.loads()[picked].waiting == 0  # the picked worker's last report, re-applied


def test_a_burst_between_load_reports_is_spread_by_the_load_it_adds():
    state = RoutingState("kv_events", 16, cap=8)
    for w in ("a", "b"):
        state.router.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100))
    picks = [state.rank([1000 + i], 300, None, ["a", "b"])[0] for i in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_a_just_routed_prefix_does_not_override_the_load_balance_once_the_index_shows_it():
    # The record of prefixes in flight bridges the moments before a prefix's KV events arrive. Once
    # the index shows the prefix on its worker, the policy's cost (which counts that cache hit
    # against the worker's load) decides alone: a worker busy decoding, with no prompt queued at
    # its last report, must not keep every request of its prefix.
    log = EventLog()
    prompt = list(range(100, 120))  # 20 blocks of 16 tokens
    log.publish(stored("a", 0, prompt))
    log.publish(stored("b", 0, []))
    for w in ("a", "b"):
        log.update_load(WorkerLoad(w, kv_free_blocks=100, kv_total_blocks=100))
    state = RoutingState("kv_events", 16, cap=256)
    state.apply(log.poll(None, 0))
    assert state.rank(prompt, 320, None, ["a", "b"])[0] == "a"  # cached there (and now just routed)
    log.update_load(WorkerLoad("a", running=60, running_decode_tokens=60 * 331,
                               kv_free_blocks=50, kv_total_blocks=100))
    state.apply(log.poll(state.instance, state.cursor))
    assert state.rank(prompt, 320, None, ["a", "b"])[0] == "b"


def test_batches_a_fetched_snapshot_already_covers_are_skipped_by_the_copy_s_index():
    # The copy's KVIndex is the one place that orders its batches: after a gap and the snapshot
    # fetched for it, the stream's older batches (inside the snapshot) are no new gap.
    log = EventLog()
    log.publish(stored("a", 0, [1]))
    state = RoutingState("kv_events", 16)
    state.apply(log.poll(None, 0))
    log.publish(stored("a", 1, [2]))
    delayed = log.poll(state.instance, state.cursor)  # batch 1 reaches the copy only at the end
    log.publish(stored("a", 2, [3]))
    assert state.apply(log.poll(state.instance, delayed.cursor)) == ["a"]  # batch 2 after 0: a gap
    state.apply_snapshot(log.snapshot("a"))
    assert state.apply(delayed) == []  # batch 1, inside the snapshot: skipped
    assert state.router.index.overlap([1, 2, 3]) == {"a": 3}


def test_a_copy_resyncing_from_a_restarted_hub_keeps_only_the_workers_it_reports():
    old = EventLog()
    old.publish(stored("a", 0, [1, 2]))
    old.publish(stored("b", 0, [5]))
    state = RoutingState("kv_events", 16)
    state.apply(old.poll(None, 0))
    restarted = EventLog()  # another instance: the copy's cursor means nothing there
    restarted.publish_snapshot(KVSnapshot("a", 7, 4, [1, 2, 3]))
    assert state.apply(restarted.poll(state.instance, state.cursor)) == []
    assert state.instance == restarted.instance
    assert sorted(state.router.worker_ids()) == ["a"]
    assert state.router.index.overlap([1, 2, 3]) == {"a": 3}
