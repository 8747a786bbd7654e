"""Router facade: events + loads + policy behind one lock."""

import threading

from kvmesh.hashing import block_hashes
from kvmesh.protocol import BlockStored, KVEventBatch, KVSnapshot, WorkerLoad
from kvmesh.router import Router

B = 16
PROMPT = list(range(8 * B))
H = block_hashes(PROMPT, B)


def stored(worker, seq, hashes, epoch=0):
    return KVEventBatch(worker, epoch, seq, [BlockStored(list(hashes), None, len(hashes) * B)])


def test_routes_to_the_worker_whose_events_report_the_prefix():
    router = Router(seed=0)
    for w in ("a", "b", "c"):
        router.add_worker(w)
    assert router.on_events(stored("b", 0, H))
    assert router.route(H, len(PROMPT))[0] == "b"


def test_a_gap_is_reported_and_a_snapshot_restores_routing():
    router = Router(seed=0)
    router.add_worker("a")
    router.add_worker("b")
    router.on_events(stored("a", 0, H[:2]))
    assert not router.on_events(stored("a", 2, H[2:]))
    assert router.workers_awaiting_snapshot() == ["a"]
    assert router.on_snapshot(KVSnapshot("a", 0, 2, H))
    assert router.workers_awaiting_snapshot() == []
    assert router.index.overlap(H) == {"a": 8}


def test_removed_and_unhealthy_workers_are_not_routed_to():
    router = Router(seed=0)
    for w in ("a", "b", "c"):
        router.add_worker(w)
    router.on_events(stored("a", 0, H))
    router.remove_worker("a")
    router.update_load(WorkerLoad("b", healthy=False))
    assert router.route(H, len(PROMPT)) == ["c"]
    assert router.index.num_blocks == 0


def test_update_load_adds_an_unknown_worker_with_the_default_cap():
    router = Router(policy="least_loaded", default_cap=2, seed=0)
    router.update_load(WorkerLoad("x", running=2))
    router.update_load(WorkerLoad("y", running=1))
    assert router.route(H, len(PROMPT)) == ["y", "x"]  # x is full: spill-over only
    assert router.worker_state("x").cap == 2


def test_concurrent_routing_and_updates_stay_consistent():
    router = Router(seed=0)
    workers = [f"w{i}" for i in range(8)]
    for w in workers:
        router.add_worker(w)
    errors = []

    def feed(w):
        try:
            for seq in range(200):
                router.on_events(stored(w, seq, block_hashes([seq] * B, B)))
                router.update_load(WorkerLoad(w, running=seq % 5))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    def route():
        try:
            for _ in range(500):
                assert sorted(router.route(H, len(PROMPT))) == sorted(workers)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=feed, args=(w,)) for w in workers] + [threading.Thread(target=route)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(not router.index.awaiting_snapshot(w) for w in workers)


def test_adding_a_known_worker_again_keeps_its_health_load_and_blocks():
    router = Router(default_cap=4, seed=0)
    router.add_worker("a", cap=9)
    router.on_events(stored("a", 0, H))
    router.set_healthy("a", False)
    router.update_load(WorkerLoad("a", running=3))
    router.add_worker("a")
    state = router.worker_state("a")
    assert (state.cap, state.healthy, state.load.running) == (9, False, 3)
    assert router.index.overlap(H) == {"a": 8}
    router.add_worker("a", cap=2)
    assert router.worker_state("a").cap == 2


def test_a_routed_request_counts_in_its_worker_s_load_until_the_next_report():
    router = Router(policy="least_loaded", seed=0)
    router.add_worker("a")
    router.on_events(stored("a", 0, H[:3]))  # 3 of the prompt's 8 blocks cached there
    router.update_load(WorkerLoad("a", waiting=1, waiting_prefill_tokens=50, timestamp=7.0))
    router.count_routed("a", H, len(PROMPT))
    load = router.worker_state("a").load
    assert (load.waiting, load.waiting_prefill_tokens, load.timestamp) == (2, 50 + 5 * B, 7.0)
    router.count_routed("a", H[:3], 3 * B)  # all cached: still one token to compute
    assert router.worker_state("a").load.waiting_prefill_tokens == 50 + 5 * B + 1
    router.count_routed("unknown", H, len(PROMPT))  # ignored
    router.update_load(WorkerLoad("a", waiting=0, timestamp=8.0))  # the report replaces the count
    assert router.worker_state("a").load.waiting == 0


def test_the_time_a_worker_s_reports_last_changed_is_noted_with_the_caller_s_clock():
    router = Router(seed=0)
    router.update_load(WorkerLoad("a", timestamp=1.0))  # no clock given: nothing noted
    assert router.worker_state("a").reported_at is None
    router.update_load(WorkerLoad("a", timestamp=1.0), now=10.0)
    router.update_load(WorkerLoad("a", timestamp=1.0, running=3), now=20.0)  # same report time
    assert router.worker_state("a").reported_at == 10.0
    router.count_routed("a", H, len(PROMPT))  # this router's own count is not news from the worker
    router.update_load(router.worker_state("a").load, now=30.0)
    assert router.worker_state("a").reported_at == 10.0
    router.update_load(WorkerLoad("a", timestamp=2.0), now=40.0)
    assert router.worker_state("a").reported_at == 40.0
