"""One router copy's view of the cluster: a kvmesh.router.Router (KV index + policy + loads) fed
from the KV event hub's stream, behind a lock (Serve calls the request router from its own thread
and event loop, and the hub consumer runs beside it).

Keeps, per worker, the (epoch, seq) it has applied, so that after fetching a worker's snapshot the
older batches still in the stream are skipped instead of being mistaken for a gap.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

from kvmesh.cluster.event_log import PollResult, WorkerGone
from kvmesh.cluster.recent_routes import RecentRoutes
from kvmesh.protocol import KVEventBatch, KVSnapshot

# A worker reports its load at least every second (its heartbeat). One not heard from for this long
# is stalled or dying: it is ranked after every worker that is still reporting, so new requests
# stop waiting on it within seconds (it still takes spill-over if every worker is stale). A replica
# whose actor still reports while its engine is frozen says so itself (WorkerLoad.stalled) and is
# ranked the same way.
STALE_LOAD_S = float(os.environ.get("KVMESH_STALE_LOAD_S", "3.0"))


class RoutingState:
    def __init__(self, policy: str, block_size: int, cap: int | None = None,
                 temperature: float = 0.0):
        from kvmesh.router import Router

        options = {"temperature": temperature} if policy == "kv_events" else {}
        # cap = the replicas' max_ongoing_requests: beyond it a worker is ranked after the others.
        self.router = Router(policy=policy, block_size=block_size, default_cap=cap, **options)
        self.block_size = block_size
        self.recent = RecentRoutes() if policy == "kv_events" else None
        self.policy = policy
        self._lock = threading.Lock()
        self._applied: dict[str, tuple[int, int]] = {}  # worker -> (epoch, last applied seq)
        self._live: set[str] = set()  # workers Serve says are running
        self.instance: str | None = None
        self.cursor = 0
        self.loads: dict = {}
        self.stats: dict = {}
        self._heard: dict[str, tuple[float, float]] = {}  # worker -> (load timestamp, when it changed)

    # ---- the hub's stream --------------------------------------------------------------------

    def apply(self, result: PollResult) -> list[str]:
        """Apply one poll's entries; returns workers whose snapshot must be fetched (a gap)."""
        need_snapshot = []
        with self._lock:
            if result.resync:
                for wid in list(self._applied):
                    self.router.remove_worker(wid)
                self._applied.clear()
            for entry in result.entries:
                if isinstance(entry, KVSnapshot):
                    self._apply_snapshot(entry)
                elif isinstance(entry, KVEventBatch):
                    if not self._apply_batch(entry):
                        need_snapshot.append(entry.worker_id)
                elif isinstance(entry, WorkerGone):
                    self._applied.pop(entry.worker_id, None)
                    self.router.remove_worker(entry.worker_id)
            now = time.monotonic()
            for load in result.loads.values():
                if load.worker_id in self._applied:
                    self.router.update_load(load)
                heard = self._heard.get(load.worker_id)
                if heard is None or heard[0] != load.timestamp:
                    self._heard[load.worker_id] = (load.timestamp, now)
            self.loads = dict(result.loads)
            self.stats = dict(result.stats)
            self.instance, self.cursor = result.instance, result.cursor
        return need_snapshot

    def apply_snapshot(self, snap: KVSnapshot) -> None:
        with self._lock:
            self._apply_snapshot(snap)

    def _apply_snapshot(self, snap: KVSnapshot) -> None:
        self.router.add_worker(snap.worker_id)
        self.router.on_snapshot(snap)
        self._applied[snap.worker_id] = (snap.epoch, snap.seq)

    def _apply_batch(self, batch: KVEventBatch) -> bool:
        applied = self._applied.get(batch.worker_id)
        if applied is not None and applied[0] == batch.epoch and batch.seq <= applied[1]:
            return True  # already inside a snapshot we applied
        if applied is None:
            self.router.add_worker(batch.worker_id)
        ok = self.router.on_events(batch)
        if ok:
            self._applied[batch.worker_id] = (batch.epoch, batch.seq)
        return bool(ok)

    # ---- Serve's replica set -----------------------------------------------------------------

    def set_live_workers(self, worker_ids) -> list[str]:
        """Serve's current replicas; returns the ones that left (to drop from the index)."""
        worker_ids = set(worker_ids)
        with self._lock:
            gone = sorted(self._live - worker_ids)
            self._live = worker_ids
            for wid in gone:
                self._applied.pop(wid, None)
                self.router.remove_worker(wid)
                if self.recent is not None:
                    self.recent.forget_worker(wid)
        return gone

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._heard.pop(worker_id, None)
            self._live.discard(worker_id)
            self._applied.pop(worker_id, None)
            self.router.remove_worker(worker_id)

    # ---- routing -----------------------------------------------------------------------------

    def rank(self, block_hashes: list[int], num_prompt_tokens: int, session_key: str | None,
             candidates: list[str], avoid: list[str] | tuple = ()) -> list[str]:
        """Candidates in the policy's order of preference (every candidate appears once); stale
        or stalled workers after the others, and last the ones in `avoid` (whose engine died under
        this very request: the router's view of them may not show it yet)."""
        with self._lock:
            for wid in candidates:
                if wid not in self._applied:
                    self.router.add_worker(wid)  # running but not heard from yet: no cache
            ranked = self.router.route(block_hashes, num_prompt_tokens, session_key=session_key)
            if self.recent is not None and ranked:
                ranked = self._prefer_recent(ranked, block_hashes)
                self.recent.record(block_hashes, ranked[0])
            if ranked:
                self._count_routed(ranked[0], block_hashes, num_prompt_tokens)
        candidate_set = set(candidates)
        order = [w for w in ranked if w in candidate_set]
        seen = set(order)
        order += [w for w in candidates if w not in seen]
        for last in (self.stale_workers(), set(avoid)):
            if last:
                order = [w for w in order if w not in last] + [w for w in order if w in last]
        return order

    def stale_workers(self, now: float | None = None) -> set[str]:
        """Workers whose load report has not changed for STALE_LOAD_S (never-heard ones are new,
        not stale), or whose last report says their engine is stalled."""
        now = time.monotonic() if now is None else now
        with self._lock:
            heard = list(self._heard.items())
            stalled = {w for w, load in self.loads.items() if load.stalled}
        return stalled | {w for w, (_, changed) in heard if now - changed > STALE_LOAD_S}

    def _count_routed(self, worker_id: str, block_hashes: list[int], num_prompt_tokens: int) -> None:
        """Add the request to the worker's load as this copy sees it, until the worker's next report
        (which then includes it): a burst routed between two reports is spread by load instead of
        all landing on the worker that looked idlest at the last report."""
        state = self.router.worker_state(worker_id)
        if state is None:
            return
        with self.router._lock:
            cached = self.router.index.overlap(block_hashes, [worker_id]).get(worker_id, 0)
        new_tokens = max(1, num_prompt_tokens - cached * self.block_size)
        load = state.load
        self.router.update_load(dataclasses.replace(
            load, waiting=load.waiting + 1,
            waiting_prefill_tokens=load.waiting_prefill_tokens + new_tokens))

    def _prefer_recent(self, ranked: list[str], block_hashes: list[int]) -> list[str]:
        """Move to the front a worker that was just sent this prefix, when the index does not show
        it yet and the prefill it saves outweighs the prompt tokens already queued there."""
        worker, num_blocks = self.recent.match(block_hashes)
        if worker is None or worker == ranked[0] or worker not in ranked:
            return ranked
        with self.router._lock:  # the index is read under the router's own lock
            known = self.router.index.overlap(block_hashes, [ranked[0], worker])
        saved = (num_blocks - known.get(worker, 0)) * self.block_size
        state = self.router.worker_state(worker)
        if state is None or state.full or not state.healthy:
            return ranked
        # The queue as the worker last reported it: this copy's own additions since (_count_routed)
        # include the very request that is computing this prefix, which must not count against it.
        reported = self.loads.get(worker)
        queued = reported.waiting_prefill_tokens if reported is not None else 0
        # saved == 0: the index already shows the prefix there, and the policy's cost has weighed
        # that hit against the worker's load; overriding it would pin every request of a prefix to
        # its worker whenever no prompt happened to be queued at its last report.
        if saved <= 0 or known.get(ranked[0], 0) >= num_blocks or saved < queued:
            return ranked
        return [worker] + [w for w in ranked if w != worker]

