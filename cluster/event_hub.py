"""The KV event hub: a named Ray actor holding the cluster's EventLog (router/event_log.py).

Workers publish to it and every router copy long-polls it, so all copies see the same ordered
stream. It is found by name (`kvmesh-kv-events-<app>` in the "serve" namespace) and created by
whichever process needs it first; it is detached so that no single worker or ingress owns its
life, and `kvmesh serve` removes it on shutdown. If it dies it is created again empty: workers are
then told to send snapshots and router copies resync (the log's instance id changed).

It also keeps each ingress replica's latest request-metric samples, so that every replica's
/metrics shows the cluster's totals (shared_metrics.py).
"""

from __future__ import annotations

import asyncio

import ray

from kvmesh.cluster.shared_metrics import ReplicaSamples, Samples
from kvmesh.protocol import KVEventBatch, KVSnapshot, WorkerLoad
from kvmesh.router.event_log import EventLog, PollResult

NAMESPACE = "serve"
SILENCE_S = 30.0  # a worker that publishes nothing (not even a load) this long is dropped


def hub_name(app_name: str) -> str:
    return f"kvmesh-kv-events-{app_name}"


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class KVEventHub:
    def __init__(self):
        self.log = EventLog()
        self.ingress_samples = ReplicaSamples()
        self._changed = asyncio.Event()
        self._janitor = None

    def _notify(self):
        self._changed.set()
        self._changed = asyncio.Event()
        if self._janitor is None:
            self._janitor = asyncio.get_running_loop().create_task(self._drop_silent())

    async def _drop_silent(self):
        while True:
            await asyncio.sleep(SILENCE_S / 4)
            if self.log.remove_silent(SILENCE_S):
                self._notify()

    async def publish(self, batches: list[KVEventBatch], load: WorkerLoad | None,
                      stats: dict | None, block_size: int) -> bool:
        """Apply a worker's batches (in order) and its load; False: send a snapshot."""
        ok = True
        for batch in batches:
            ok = self.log.publish(batch, block_size) and ok
        if load is not None:
            # An idle worker publishes only its load: after a hub restart that is how it learns
            # the hub forgot it (False: send a snapshot), or it would stay unknown until its next
            # KV event.
            ok = self.log.update_load(load, stats) and ok
        self._notify()
        return ok

    async def publish_snapshot(self, snap: KVSnapshot, load: WorkerLoad | None, stats: dict | None):
        self.log.publish_snapshot(snap)
        if load is not None:
            self.log.update_load(load, stats)
        self._notify()

    async def remove_worker(self, worker_id: str) -> bool:
        removed = self.log.remove_worker(worker_id)
        if removed:
            self._notify()
        return removed

    async def poll(self, instance: str | None, cursor: int, timeout_s: float) -> PollResult:
        """What was appended after `cursor`, waiting up to timeout_s for something new."""
        if instance == self.log.instance and not self.log.has_after(cursor):
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.log.poll(instance, cursor)

    async def snapshot(self, worker_id: str) -> KVSnapshot | None:
        return self.log.snapshot(worker_id)

    async def loads(self) -> tuple[dict, dict]:
        return self.log.loads(), self.log.stats()

    async def publish_ingress_metrics(self, replica_id: str, samples: Samples) -> Samples:
        """Keep an ingress replica's request-metric samples; the sum of every other replica's."""
        return self.ingress_samples.publish(replica_id, samples)


def get_or_create_hub(app_name: str):
    """The app's hub actor handle (created detached on first use). Safe to call concurrently."""
    return KVEventHub.options(name=hub_name(app_name), namespace=NAMESPACE, get_if_exists=True,
                              lifetime="detached").remote()


def kill_hub(app_name: str) -> bool:
    return kill_named(hub_name(app_name))


def kill_named(name: str) -> bool:
    """Kill the detached actor of that name in NAMESPACE (the hub, the response store); False when
    there is none."""
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True
