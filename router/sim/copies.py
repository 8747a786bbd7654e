"""The serving cluster's router copies, in the simulator: arrivals routed by N `RoutingState`s in turn,
fed late through a real `EventLog`, as the cluster's ingress replicas are.

In the cluster (cluster/request_router.py, cluster/worker.py `_publish_forever`) each ingress replica
holds its own RoutingState (a Router with the kv_events policy's record of prefixes in flight, its
own load increments for what it routed since the last report, stale-worker demotion); Serve's proxy
spreads requests across the replicas; every worker publishes its KV event batches and its load to
the hub, and every copy polls the hub. So a copy routes on loads up to a report interval old, on an
index that lags each step by the trip worker -> hub -> copy, and knows nothing of what the other
copies just routed.

Here: a publication a worker makes at time t (the KV event batch of a step that ended at t, and its
load every `report_interval_s`, or with every batch too under `loads_with_events`, as the cluster's
worker does) is appended to the EventLog at t + `event_delay_s`, and every copy then polls and applies
it (the copies long-poll, so they all get it at once). Requests go to copy k mod N. Serve's
spill-over at max_ongoing_requests (`cap`, checked against the worker's true queue) picks the first
rank with room; the copies themselves have no cap, as in cluster/app.py.

Each copy is a RoutingState made simulation-safe through its constructor: its policy's
tie-breaking generator is seeded from `config.seed` and the copy's number (the cluster's copies are
unseeded; a simulation must repeat), it hears loads on the simulated clock, and silence is not
measured (stale-worker demotion off: every simulated worker reports at every tick and never stalls).
"""

from __future__ import annotations

import heapq
import time

from kvmesh.protocol import KVSnapshot
from kvmesh.router.event_log import EventLog
from kvmesh.router.routing_state import RoutingState

# At one instant a tick (reads the workers) comes before a delivery (writes the copies): independent.
_TICK, _DELIVER = 0, 1


class RouterCopies:
    """The N copies, the hub's log between them and the workers, and the pending deliveries.

    The simulator interleaves `next_time()` / `fire()` with its own events (a copy event at the same
    instant as a worker event goes first), calls `on_step_end` after each step and `route` per
    arrival."""

    def __init__(self, config, policy: str, workers, state_class=RoutingState,
                 policy_options: dict | None = None):
        self.config = config
        self.workers = {w.worker_id: w for w in workers}
        self.worker_ids = list(self.workers)
        self.now = 0.0
        self.log = EventLog(clock=self._clock)
        self.copies = [state_class(policy, config.block_size, cap=None, seed=[config.seed, number],
                                   clock=self._clock, stale_load_s=None, policy_options=policy_options)
                       for number in range(config.router_copies)]
        self.routed = 0
        self._queue: list = []  # (time, kind, order, payload)
        self._order = 0
        for w in workers:  # the worker's announcement: an empty cache, then its load
            self.log.publish_snapshot(KVSnapshot(w.worker_id, 0, -1, [], config.block_size))
            self.log.update_load(w.load(0.0))
        self._poll_all()
        if config.report_interval_s > 0:
            self._push(config.report_interval_s, _TICK, None)

    def _clock(self) -> float:
        return self.now

    @property
    def router(self):
        """The first copy's Router (what the run's metrics read: index size)."""
        return self.copies[0].router

    # ---- the simulator's side ----------------------------------------------------------------

    def next_time(self) -> float:
        return self._queue[0][0] if self._queue else float("inf")

    def fire(self) -> None:
        """Process the earliest pending tick or delivery."""
        when, kind, _, payload = heapq.heappop(self._queue)
        self.now = when
        if kind == _TICK:
            loads = [w.load(when) for w in self.workers.values()]
            self._push(when + self.config.event_delay_s, _DELIVER, (None, loads))
            self._push(when + self.config.report_interval_s, _TICK, None)
        else:
            batch, loads = payload
            if batch is not None and not self.log.publish(batch, self.config.block_size):
                raise AssertionError(f"simulated worker {batch.worker_id} sent a batch out of order")
            for load in loads:
                self.log.update_load(load)
            self._poll_all()

    def on_step_end(self, worker, now: float) -> None:
        batch = worker.take_event_batch(now)
        if batch is None:
            return
        loads = [worker.load(now)] if self.config.loads_with_events else []
        self._push(now + self.config.event_delay_s, _DELIVER, (batch, loads))

    def route(self, block_hashes: list[int], num_prompt_tokens: int, session_key: str | None,
              now: float, request_id: str | None = None) -> tuple[str, int]:
        """(the worker the request goes to, the decision's wall time in ns). With `request_id`, call
        `finished` when the request ends."""
        self.now = now
        copy = self.copies[self.routed % len(self.copies)]
        self.routed += 1
        t0 = time.perf_counter_ns()
        order = copy.rank(block_hashes, num_prompt_tokens, session_key, self.worker_ids,
                          request_id=request_id)
        elapsed = time.perf_counter_ns() - t0
        cap = self.config.cap
        if cap is not None:  # Serve: a replica at max_ongoing_requests rejects, the next rank is tried
            for worker_id in order:
                if self.workers[worker_id].outstanding < cap:
                    return worker_id, elapsed
        return order[0], elapsed

    def finished(self, request_id: str, now: float) -> None:
        """The request has ended on its worker: the copy that routed it hears so at once (in the
        cluster the ingress holding that copy receives the last token; RoutingState.finished)."""
        self.now = now
        for copy in self.copies:  # the one that remembers it (RoutingState keeps what it routed)
            if copy.finished(request_id):
                return

    # ---- internals ---------------------------------------------------------------------------

    def _poll_all(self) -> None:
        for state in self.copies:
            missing = state.apply(self.log.poll(state.instance, state.cursor))
            for worker_id in missing:  # cannot happen with in-order delivery; handled as the cluster does
                state.apply_snapshot(self.log.snapshot(worker_id))

    def _push(self, when: float, kind: int, payload) -> None:
        heapq.heappush(self._queue, (when, kind, self._order, payload))
        self._order += 1
