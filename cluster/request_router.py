"""The KV-aware Serve request router for the worker deployment.

Serve builds one copy per process that holds a handle to the workers (each ingress replica). Each
copy consumes the whole KV event stream from the hub (long polls, in a task on the router's event
loop) into its RoutingState (router/routing_state.py), so all copies route from the same index; a
copy that starts late or falls behind resyncs from the hub's snapshots. For each request,
`choose_replicas` ranks the candidate replicas with the configured kvmesh policy on the request's
block hashes (`pending_request.args[0]` is the RoutedRequest) and returns one replica per rank:
Serve tries the best first and spills over to the next when a replica is at max_ongoing_requests.
"""

from __future__ import annotations

import asyncio
import logging
import os

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvmesh.cluster import router_copies
from kvmesh.cluster.event_hub import get_or_create_hub
from kvmesh.cluster.messages import RoutedRequest
from kvmesh.router.gc_tuning import tune_gc_for_routing
from kvmesh.router.routing_state import RoutingState

logger = logging.getLogger("kvmesh.cluster")

SYNC_WAIT_S = 2.0
DEBUG = os.environ.get("KVMESH_DEBUG_ROUTING") == "1"


class KVAwareRequestRouter(RequestRouter):
    # Serve asks the ranked replica for its queue length before sending; if no answer comes
    # within the deadline it moves on to the next rank. Serve's 0.1 s default sent cache hits to
    # the wrong worker whenever the right one's event loop was busy for a moment (a 2-core box):
    # the wait for the right worker is cheaper than recomputing the prefix elsewhere.
    queue_len_response_deadline_s = 0.5
    max_queue_len_response_deadline_s = 2.0

    def initialize_state(self, app_name: str = "kvmesh", policy: str = "kv_events",
                         block_size: int = 16, cap: int | None = None, temperature: float = 0.0,
                         poll_timeout_s: float = 1.0, policy_options: dict | None = None):
        self.hub_app_name = app_name
        self.poll_timeout_s = poll_timeout_s
        tune_gc_for_routing()  # this process holds a router copy's index (router/gc_tuning.py)
        self.state = RoutingState(policy, block_size, cap=cap, temperature=temperature,
                                  policy_options=policy_options)
        self.hub = get_or_create_hub(app_name)
        self._synced = asyncio.Event()  # set once the first poll (a full snapshot) is applied
        self.loop = asyncio.get_running_loop()  # the ingress posts request ends here (router_copies)
        self._consumer = self.loop.create_task(self._consume_events())
        router_copies.track(self)  # by module attribute: this module is pickled by value

    async def _consume_events(self):
        while True:
            try:
                result = await self.hub.poll.remote(self.state.instance, self.state.cursor,
                                                    self.poll_timeout_s)
                for worker_id in self.state.apply(result):
                    snap = await self.hub.snapshot.remote(worker_id)
                    if snap is not None:
                        self.state.apply_snapshot(snap)
                self._synced.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the hub restarted or is unreachable: retry, resync follows
                logger.warning("kvmesh router: polling KV events failed: %r", e)
                await asyncio.sleep(0.5)
                self.hub = get_or_create_hub(self.hub_app_name)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        routed = None
        if pending_request is not None and pending_request.args:
            first = pending_request.args[0]
            routed = first if isinstance(first, RoutedRequest) else None
        if routed is None:  # control calls (model_info, load): any replica
            return [candidate_replicas]
        if not self._synced.is_set():
            # A new copy (a new ingress replica, or its first request) routes from the cluster's
            # caches, not from an empty index: wait for its first snapshot, briefly.
            try:
                await asyncio.wait_for(self._synced.wait(), SYNC_WAIT_S)
            except asyncio.TimeoutError:
                pass
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = self.state.rank(routed.block_hashes, routed.num_prompt_tokens,
                                routed.session_key, list(by_id), avoid=routed.avoid_workers,
                                request_id=routed.request_id, keep_stale=False)
        if DEBUG:
            logger.warning("kvmesh route %s: %s synced=%s cursor=%s overlap=%s loads=%s",
                           routed.request_id, order, self._synced.is_set(), self.state.cursor,
                           self.state.router.index.overlap(routed.block_hashes),
                           {w: (l.running, l.waiting, l.waiting_prefill_tokens)
                            for w, l in self.state.loads().items()})
        return [[by_id[w]] for w in order]

    def update_replicas(self, replicas: list[RunningReplica]):
        super().update_replicas(replicas)
        if not hasattr(self, "state"):  # before initialize_state
            return
        gone = self.state.set_live_workers(r.replica_id.unique_id for r in replicas)
        for worker_id in gone:
            self.hub.remove_worker.remote(worker_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        if not hasattr(self, "state"):
            return
        self.state.remove_worker(replica_id.unique_id)
        self.hub.remove_worker.remote(replica_id.unique_id)
