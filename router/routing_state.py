"""One router copy's view of the cluster: a Router (KV index + policy + loads) fed from the KV event
stream (router/event_log.py's `PollResult`s), behind a lock (Serve calls the request router from its
own thread and event loop, and the hub consumer runs beside it).

The cluster's request router (cluster/request_router.py) holds one per ingress replica; the
simulator's router copies (router/sim/copies.py) hold N of them, seeded and on the simulated clock.
Everything this copy knows lives in its Router: batches are ordered by the index (KVIndex.apply skips
what a snapshot already covers and asks for a snapshot on a gap), loads and when they last changed by
the WorkerSet, prefixes in flight by the kv_events policy (router/pending.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import contextmanager

from kvmesh.hashing import hash_array
from kvmesh.protocol import KVEventBatch, KVSnapshot, WorkerLoad
from kvmesh.router.event_log import PollResult, WorkerGone
from kvmesh.router.policies import policy_options as policy_options_of
from kvmesh.router.router import Router

# A worker reports its load at least every second (its heartbeat). One not heard from for this long
# is stalled or dying: it is ranked after every worker that is still reporting, so new requests
# stop waiting on it within seconds; the cluster's copies leave it out while another worker can
# serve (rank's keep_stale), so Serve cannot spill requests onto it when the others are full. A
# replica whose actor still reports while its engine is frozen says so itself (WorkerLoad.stalled)
# and is treated the same way.
STALE_LOAD_S = float(os.environ.get("KVMESH_STALE_LOAD_S", "3.0"))
# Requests this copy routed whose end it has not heard yet (`finished`), newest last; beyond this
# many the oldest are forgotten (a request that never reports its end costs one entry, for a while).
MAX_ROUTED_REQUESTS = 4096


class RoutingState:
    def __init__(self, policy: str, block_size: int, cap: int | None = None, temperature: float = 0.0,
                 seed=None, clock: Callable[[], float] = time.monotonic,
                 stale_load_s: float | None = STALE_LOAD_S, policy_options: dict | None = None):
        """`cap`: the replicas' max_ongoing_requests (beyond it a worker is ranked after the others).
        `seed`: the policy's tie-breaking generator (anything numpy's default_rng takes; None: from
        the OS, as the cluster's copies run). `clock`: when loads are heard (a simulation passes its
        own). `stale_load_s`: a worker whose reports have not changed for this long is ranked after
        the others; None: silence is not measured (a simulation, whose workers never fall silent),
        only a load that says `stalled` demotes. `policy_options`: the policy's options as a config
        gives them (router.policies.policy_options)."""
        if stale_load_s is not None and stale_load_s <= 0:
            raise ValueError(f"stale_load_s must be > 0 or None, got {stale_load_s}")
        options = policy_options_of(policy, policy_options)
        if temperature:  # a policy without one refuses it
            options["temperature"] = temperature
        self.router = Router(policy=policy, block_size=block_size, default_cap=cap, seed=seed, **options)
        self.policy = policy
        self.clock = clock
        self.stale_load_s = stale_load_s
        self._lock = threading.Lock()
        self._live: set[str] = set()  # workers Serve says are running
        self.instance: str | None = None
        self.cursor = 0
        # request id -> (the worker it was sent to, its block hashes as routed), until it ends
        self._routed: OrderedDict[str, tuple[str, Sequence[int]]] = OrderedDict()

    # ---- the hub's stream --------------------------------------------------------------------

    def apply(self, result: PollResult) -> list[str]:
        """Apply one poll's entries; returns workers whose snapshot must be fetched (a gap)."""
        need_snapshot = []
        with self._lock:
            if result.resync:
                for wid in self.router.worker_ids():
                    self.router.remove_worker(wid)
            for entry in result.entries:
                if isinstance(entry, KVSnapshot):
                    self._apply_snapshot(entry)
                elif isinstance(entry, KVEventBatch):
                    self.router.add_worker(entry.worker_id)
                    if not self.router.on_events(entry):
                        need_snapshot.append(entry.worker_id)
                elif isinstance(entry, WorkerGone):
                    self.router.remove_worker(entry.worker_id)
            now = self.clock()
            for load in result.loads.values():
                if load.worker_id in self.router.workers:  # not one that left (its loads linger)
                    self.router.update_load(load, now)
            self.instance, self.cursor = result.instance, result.cursor
        return need_snapshot

    def apply_snapshot(self, snap: KVSnapshot) -> None:
        with self._lock:
            self._apply_snapshot(snap)

    def _apply_snapshot(self, snap: KVSnapshot) -> None:
        self.router.add_worker(snap.worker_id)
        self.router.on_snapshot(snap)

    # ---- Serve's replica set -----------------------------------------------------------------

    def set_live_workers(self, worker_ids) -> list[str]:
        """Serve's current replicas; returns the ones that left (to drop from the index)."""
        worker_ids = set(worker_ids)
        with self._lock:
            gone = sorted(self._live - worker_ids)
            self._live = worker_ids
            for wid in gone:
                self.router.remove_worker(wid)
        return gone

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._live.discard(worker_id)
            self.router.remove_worker(worker_id)

    # ---- routing -----------------------------------------------------------------------------

    def rank(self, block_hashes: Sequence[int], num_prompt_tokens: int, session_key: str | None,
             candidates: list[str], avoid: list[str] | tuple = (), request_id: str | None = None,
             keep_stale: bool = True) -> list[str]:
        """Candidates in the policy's order of preference (every candidate appears once); stale
        or stalled workers after the others, and last the ones in `avoid` (whose engine died under
        this very request: the router's view of them may not show it yet). Those, and workers
        that are not candidates, are out of the policy's choice, so what the choice leaves behind
        (the request's count in the first worker's load until its next report, Router.count_routed;
        kv_events' record of the prefix in flight) lands on the worker that is really first.
        `request_id`: the caller will report the request's end (`finished`); a request routed
        again under the same id (a retry) is remembered on its new worker. `keep_stale` False:
        stale or stalled workers are left out while a candidate that is neither stale nor avoided
        remains (Serve spills a request over to any later rank when the ones before are full, and
        one sent to a stalled worker waits there until it resumes)."""
        stale = self.stale_workers()
        avoid = set(avoid)
        candidate_set = set(candidates)
        with self._lock:
            for wid in candidates:
                if wid not in self.router.workers:
                    self.router.add_worker(wid)  # running but not heard from yet: no cache
            out = stale | avoid
            if len(self.router.workers) != len(candidate_set):
                out |= {w for w in self.router.workers.ids if w not in candidate_set}
            block_hashes = hash_array(block_hashes)  # once, for the route and its count
            with _out_of_choice(self.router, out):
                ranked = self.router.route(block_hashes, num_prompt_tokens, session_key=session_key)
            seen = set(ranked)
            order = ranked + [w for w in candidates if w not in seen]
            for last in (stale, avoid):
                if last:
                    order = [w for w in order if w not in last] + [w for w in order if w in last]
            if not keep_stale and stale and any(w not in stale and w not in avoid for w in order):
                order = [w for w in order if w not in stale]
            if order:
                self.router.count_routed(order[0], block_hashes, num_prompt_tokens, request_id)
                if request_id is not None:
                    self._remember(request_id, order[0], block_hashes)
        return order

    def finished(self, request_id: str, computed: bool = True) -> bool:
        """The request routed under `request_id` has ended (its last output reached the ingress)
        where this copy last sent it: its count leaves that worker's load if no report has replaced
        it yet, and, if `computed` (it finished, not failed or cut short), kv_events credits the
        worker with the prompt's blocks as cached until the index shows them
        (Router.finish_routed). Before this the copy may not yet have heard the worker's events: a
        conversation's next turn, sent as the answer arrives, would see its prefix nowhere and its
        worker still busy with the turn before. False if this copy did not route it (or has
        forgotten it)."""
        with self._lock:
            routed = self._routed.pop(request_id, None)
            if routed is None:
                return False
            worker_id, block_hashes = routed
            self.router.finish_routed(worker_id, block_hashes, request_id, computed)
        return True

    def _remember(self, request_id: str, worker_id: str, block_hashes: Sequence[int]) -> None:
        routed = self._routed
        routed[request_id] = (worker_id, block_hashes)
        routed.move_to_end(request_id)
        if len(routed) > MAX_ROUTED_REQUESTS:
            routed.popitem(last=False)

    def stale_workers(self, now: float | None = None) -> set[str]:
        """Workers whose load reports have not changed for `stale_load_s` (never-heard ones are
        new, not stale), or whose last report says their engine is stalled."""
        now = self.clock() if now is None else now
        silent_s = self.stale_load_s
        with self._lock:
            return {s.worker_id for s in self.router.workers
                    if s.load.stalled or (silent_s is not None and s.reported_at is not None
                                          and now - s.reported_at > silent_s)}

    def loads(self) -> dict[str, WorkerLoad]:
        """Each worker's load as this copy sees it: its last report plus what this copy routed to
        it since."""
        with self._lock:
            return {s.worker_id: s.load for s in self.router.workers}


@contextmanager
def _out_of_choice(router: Router, worker_ids: set[str]):
    """Workers marked unhealthy for one route (policies never return those), then as they were."""
    flipped = [w for w in worker_ids if (state := router.workers.get(w)) is not None and state.healthy]
    for w in flipped:
        router.set_healthy(w, False)
    try:
        yield
    finally:
        for w in flipped:
            router.set_healthy(w, True)
