"""The KV event hub drops a worker that published nothing for SILENCE_S (30 s: one that died without
leaving, docs/SERVING.md) and keeps one that keeps publishing. The hub actor's class runs here in
this process, its janitor task on this event loop, with SILENCE_S shortened."""

import asyncio
import time

from kvmesh.cluster import event_hub
from kvmesh.protocol import KVSnapshot, WorkerLoad


def test_the_documented_silence_is_30_s():
    assert event_hub.SILENCE_S == 30.0


def test_a_silent_worker_is_dropped_and_a_publishing_one_kept(monkeypatch):
    silence = 0.4
    monkeypatch.setattr(event_hub, "SILENCE_S", silence)
    hub = event_hub.KVEventHub.__ray_metadata__.modified_class()  # the actor's class, in-process

    async def run():
        for worker in ("silent", "alive"):
            await hub.publish_snapshot(KVSnapshot(worker, 0, 0, []), WorkerLoad(worker, timestamp=time.time()), None)
        seen = [sorted((await hub.loads())[0])]
        deadline = time.monotonic() + 1.5 * silence  # the janitor looks every silence / 4
        while time.monotonic() < deadline:
            await asyncio.sleep(silence / 8)
            await hub.publish([], WorkerLoad("alive", timestamp=time.time()), None, 16)
        seen.append(sorted((await hub.loads())[0]))
        return seen

    assert asyncio.run(run()) == [["alive", "silent"], ["alive"]]
