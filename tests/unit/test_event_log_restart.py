"""A restarted (empty) KV event hub must learn about idle workers from their load heartbeats
(regression: update_load of an unknown worker was silently dropped, so an idle worker stayed out of
a restarted hub, and of every router copy and /metrics, until its next KV event)."""

from kvmesh.router.event_log import EventLog
from kvmesh.protocol import KVSnapshot, WorkerLoad


def test_a_load_from_an_unknown_worker_asks_for_a_snapshot():
    log = EventLog()
    assert log.update_load(WorkerLoad("w1", kv_free_blocks=10, kv_total_blocks=10)) is False
    log.publish_snapshot(KVSnapshot("w1", 7, 3, [11, 12], 16))
    assert log.update_load(WorkerLoad("w1", kv_free_blocks=9, kv_total_blocks=10)) is True
    assert log.snapshot("w1").block_hashes == [11, 12]
