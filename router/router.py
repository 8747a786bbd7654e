"""Router: the KV index, the workers' loads and a policy behind one lock.

The Serve request router (or the simulator) feeds it events, snapshots and loads, and asks it for a
ranking; every public method takes the lock, so it may be called from any thread.
"""

import threading
from array import array
from collections.abc import Sequence
from dataclasses import replace

from kvmesh.hashing import hash_array
from kvmesh.protocol import KVEventBatch, KVSnapshot, WorkerLoad
from kvmesh.router.index import KVIndex
from kvmesh.router.policies import DEFAULT_POLICY, make_policy
from kvmesh.router.policies.base import RouteRequest
from kvmesh.router.workers import WorkerSet, WorkerState


class Router:
    def __init__(self, policy: str = DEFAULT_POLICY, block_size: int = 16,
                 max_blocks: int = 1_000_000, seed: int | None = None,
                 default_cap: int | None = None, **policy_kwargs):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.default_cap = default_cap
        self.index = KVIndex(max_blocks=max_blocks)
        self.workers = WorkerSet()
        self.policy = make_policy(policy, index=self.index, block_size=block_size, seed=seed,
                                  **policy_kwargs)
        self._lock = threading.Lock()

    # ---- membership and load -----------------------------------------------------------------

    def add_worker(self, worker_id: str, cap: int | None = None) -> None:
        """Make a worker routable; `cap` = max outstanding requests (default: the router's). Adding a
        known worker again changes only its cap, and only when one is given (health, load and cached
        blocks stay)."""
        with self._lock:
            state = self.workers.get(worker_id)
            if state is not None:
                if cap is not None:
                    self.workers.set_cap(worker_id, cap)
                return
            self.workers.add(worker_id, cap=self.default_cap if cap is None else cap)
            self.index.add_worker(worker_id)
            self.policy.add_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (it died or was scaled down): its blocks leave the index."""
        with self._lock:
            self.workers.remove(worker_id)
            self.index.remove_worker(worker_id)
            self.policy.remove_worker(worker_id)

    def update_load(self, load: WorkerLoad, now: float | None = None) -> None:
        """Latest load of a worker; an unknown worker is added (with the default cap). `now`: the
        caller's clock, to note when the worker's reports last changed (WorkerState.reported_at)."""
        with self._lock:
            if load.worker_id not in self.workers:
                self.workers.add(load.worker_id, cap=self.default_cap)
                self.index.add_worker(load.worker_id)
                self.policy.add_worker(load.worker_id)
            self.workers.update_load(load, now)

    def count_routed(self, worker_id: str, block_hashes: Sequence[int], num_prompt_tokens: int,
                     request_id: str | None = None) -> None:
        """Add a request just routed to `worker_id` to its load, until the worker's next report: its
        prompt tokens past what the index shows cached there are queued prefill (at least one). For
        a router whose loads come in periodic reports (the cluster's copies): a burst routed
        between two reports is then spread by load instead of all landing on the worker that looked
        idlest at the last one. With `request_id`, `finish_routed` takes the count back when the
        request ends first. An unknown worker is ignored."""
        with self._lock:
            if worker_id not in self.workers:
                return
            cached = self.index.overlap(block_hashes, [worker_id]).get(worker_id, 0)
            self.workers.add_routed(worker_id, max(1, num_prompt_tokens - cached * self.block_size),
                                    request_id)

    def finish_routed(self, worker_id: str, block_hashes: Sequence[int], request_id: str,
                      computed: bool = True) -> None:
        """A request this router sent to `worker_id` has ended there (its last output reached the
        caller), which may be before the worker's events and load say so: its count leaves the
        worker's load if no report has replaced it yet, and if `computed` (it finished, so its
        prompt was computed) the policy learns that the worker holds the prompt's blocks
        (kv_events: its record of the prefix in flight becomes one of blocks computed, credited as
        cached until the index shows them). `block_hashes`: the ones the request was routed with
        (the same array)."""
        with self._lock:
            self.workers.remove_routed(worker_id, request_id)
            if computed:
                self.policy.on_finished(block_hashes, worker_id)

    def set_healthy(self, worker_id: str, healthy: bool) -> None:
        with self._lock:
            self.workers.set_healthy(worker_id, healthy)

    def worker_ids(self) -> list[str]:
        with self._lock:
            return self.workers.ids

    def worker_state(self, worker_id: str) -> WorkerState | None:
        with self._lock:
            return self.workers.get(worker_id)

    # ---- KV events ---------------------------------------------------------------------------

    def on_events(self, batch: KVEventBatch) -> bool:
        """Apply a worker's event batch. False: a gap or a new epoch; fetch that worker's snapshot
        and pass it to on_snapshot (its later batches are kept meanwhile)."""
        with self._lock:
            return self.index.apply(batch)

    def on_snapshot(self, snap: KVSnapshot) -> bool:
        """Resync a worker from its snapshot. False: still a gap after it; fetch a newer one."""
        with self._lock:
            return self.index.apply_snapshot(snap)

    def workers_awaiting_snapshot(self) -> list[str]:
        with self._lock:
            return self.index.workers_awaiting_snapshot()

    # ---- routing -----------------------------------------------------------------------------

    def route(self, block_hashes: Sequence[int], num_prompt_tokens: int,
              session_key: str | None = None, limit: int | None = None) -> list[str]:
        """Worker ids, best first: eligible workers in the policy's order, then full ones (spill-over).
        Empty when no worker is healthy. `limit`: only the first that many (limit=1: the choice alone,
        which the kv_events policy finds without a pass over every worker). `block_hashes`: an
        array('Q') is kept as it is (it must not change afterwards); anything else is copied into
        one (~40 ns a hash: produce the array where the hashes are made, kvmesh.hashing.hash_array)."""
        return self.route_request(RouteRequest(hash_array(block_hashes), num_prompt_tokens, session_key),
                                  limit)

    def route_request(self, request: RouteRequest, limit: int | None = None) -> list[str]:
        """As `route`. The policy keeps `request.block_hashes` (the records of prefixes in flight):
        give an array('Q'), whose hashes the garbage collector does not visit; another sequence is
        converted first (~40 ns a hash)."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        if not (isinstance(request.block_hashes, array) and request.block_hashes.typecode == "Q"):
            request = replace(request, block_hashes=hash_array(request.block_hashes))
        with self._lock:
            return self.policy.top(request, self.workers, limit)
