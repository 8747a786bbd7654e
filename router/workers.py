"""What a policy sees of each worker: `WorkerState`, and `WorkerSet`, which keeps the same data as
numpy columns so that a policy scores 1024 workers in a few vectorized operations, not a Python loop.

A worker is *eligible* for a new request when it is healthy and below its cap (outstanding requests =
running + waiting < cap). Policies rank eligible workers first; full-but-healthy workers follow (least
outstanding first) as spill-over; unhealthy workers are never returned.

A Router's WorkerSet is the one holder of its workers' loads: the last report, what the router
counted since (`add_routed`) and when a report last changed (`WorkerState.reported_at`); the
cluster's router copies and the simulator read them from here.
"""

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvmesh.protocol import WorkerLoad
from kvmesh.router.load_order import LoadKey, LoadOrder


@dataclass
class WorkerState:
    worker_id: str
    load: WorkerLoad = None  # type: ignore[assignment]  # filled in __post_init__
    healthy: bool = True
    cap: int | None = None  # max outstanding (running + waiting) requests; None = no cap
    # When (on the clock of whoever passes `now` to WorkerSet.update_load) a report with a new
    # timestamp last arrived: a worker whose reports stop changing is stalled or dying.
    reported_at: float | None = None
    # Requests counted in `load` since its last report (WorkerSet.add_routed with a request id):
    # request id -> its queued prefill tokens; None when there are none.
    routed: dict[str, int] | None = None

    def __post_init__(self):
        if self.load is None:
            self.load = WorkerLoad(worker_id=self.worker_id)

    @property
    def outstanding(self) -> int:
        return self.load.running + self.load.waiting

    @property
    def full(self) -> bool:
        return self.cap is not None and self.outstanding >= self.cap

    @property
    def eligible(self) -> bool:
        return self.healthy and self.load.healthy and not self.full


@dataclass
class LoadColumns:
    """The workers' loads as arrays, index-aligned with `ids`."""
    ids: list[str]
    healthy: np.ndarray  # [n] bool (the state's flag and the load's)
    outstanding: np.ndarray  # [n] float64, running + waiting requests
    waiting_prefill_tokens: np.ndarray  # [n] float64
    running_decode_tokens: np.ndarray  # [n] float64
    kv_usage: np.ndarray  # [n] float64 in [0, 1]
    cap: np.ndarray  # [n] float64, inf = no cap
    pos: dict[str, int] | None = None  # worker id -> row (built on first use if not given)
    id_array: np.ndarray | None = None  # [n] object: ids, for fast fancy indexing
    eligible_column: np.ndarray | None = None  # [n] bool, kept by a WorkerSet (else computed per call)

    def ids_at(self, rows) -> list[str]:
        """The ids of `rows` (an index array), in that order."""
        if self.id_array is None:
            self.id_array = np.array(self.ids, dtype=object)
        return self.id_array[rows].tolist()

    def row(self, worker_id: str) -> int | None:
        if self.pos is None:
            self.pos = {wid: i for i, wid in enumerate(self.ids)}
        return self.pos.get(worker_id)

    @classmethod
    def from_states(cls, workers: Sequence[WorkerState]) -> "LoadColumns":
        loads = [w.load for w in workers]
        return cls(
            ids=[w.worker_id for w in workers],
            healthy=np.array([w.healthy and w.load.healthy for w in workers], dtype=bool),
            outstanding=np.array([ld.running + ld.waiting for ld in loads], dtype=np.float64),
            waiting_prefill_tokens=np.array([ld.waiting_prefill_tokens for ld in loads], dtype=np.float64),
            running_decode_tokens=np.array([ld.running_decode_tokens for ld in loads], dtype=np.float64),
            kv_usage=np.array([ld.kv_usage for ld in loads], dtype=np.float64),
            cap=np.array([math.inf if w.cap is None else w.cap for w in workers], dtype=np.float64))

    @property
    def eligible(self) -> np.ndarray:
        if self.eligible_column is not None:
            return self.eligible_column
        return self.healthy & (self.outstanding < self.cap)


def columns_of(workers: Sequence[WorkerState]) -> LoadColumns:
    """The columns of `workers`: kept up to date by a WorkerSet, built on the fly for a list."""
    if isinstance(workers, WorkerSet):
        return workers.columns()
    return LoadColumns.from_states(workers)


class WorkerSet(Sequence[WorkerState]):
    """The router's workers, as a sequence of WorkerState plus columns updated in place (O(1) per
    load update; removal moves the last worker into the freed row)."""

    def __init__(self):
        self._states: list[WorkerState] = []
        self._pos: dict[str, int] = {}
        self._n = 0
        self._store = LoadColumns.from_states([])
        self._store.eligible_column = np.zeros(0, dtype=bool)
        self._id_array = np.empty(0, dtype=object)
        self._orders: list[LoadOrder] = []  # kept up to date with every load (watch)
        self._columns: LoadColumns | None = None  # views of the current rows, until the next add/remove
        self._grow(16)

    def _grow(self, capacity: int) -> None:
        old, n = self._store, self._n
        self._columns = None

        def resized(arr, fill, dtype):
            new = np.full(capacity, fill, dtype=dtype)
            new[:n] = arr[:n]
            return new
        self._store = LoadColumns(
            ids=old.ids,
            healthy=resized(old.healthy, False, bool),
            outstanding=resized(old.outstanding, 0.0, np.float64),
            waiting_prefill_tokens=resized(old.waiting_prefill_tokens, 0.0, np.float64),
            running_decode_tokens=resized(old.running_decode_tokens, 0.0, np.float64),
            kv_usage=resized(old.kv_usage, 0.0, np.float64),
            cap=resized(old.cap, math.inf, np.float64),
            eligible_column=resized(old.eligible_column, False, bool))
        self._id_array = resized(self._id_array, None, object)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._states[i]

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(self._states)

    def __contains__(self, worker_id) -> bool:
        return worker_id in self._pos

    def get(self, worker_id: str) -> WorkerState | None:
        i = self._pos.get(worker_id)
        return None if i is None else self._states[i]

    @property
    def ids(self) -> list[str]:
        return list(self._store.ids)

    def add(self, worker_id: str, cap: int | None = None, healthy: bool = True) -> WorkerState:
        if worker_id in self._pos:  # known: keep its state, take the new cap
            self.set_cap(worker_id, cap)
            return self._states[self._pos[worker_id]]
        if self._n == len(self._store.healthy):
            self._grow(2 * self._n)
        state = WorkerState(worker_id, cap=cap, healthy=healthy)
        self._states.append(state)
        self._store.ids.append(worker_id)
        self._id_array[self._n] = worker_id
        self._pos[worker_id] = self._n
        self._n += 1
        self._columns = None
        self._write(self._n - 1)
        return state

    def remove(self, worker_id: str) -> None:
        i = self._pos.pop(worker_id, None)
        if i is None:
            return
        last = self._n - 1
        if i != last:
            moved = self._states[last]
            self._states[i] = moved
            self._store.ids[i] = moved.worker_id
            self._id_array[i] = moved.worker_id
            self._pos[moved.worker_id] = i
            self._write(i)
        self._states.pop()
        self._store.ids.pop()
        self._id_array[last] = None
        self._n -= 1
        self._columns = None
        for order in self._orders:
            order.discard(worker_id)

    def watch(self, order: LoadOrder) -> None:
        """Keep `order` up to date with every worker's load and eligibility from now on."""
        self._orders.append(order)
        for i in range(self._n):
            self._update_orders(i)

    def update_load(self, load: WorkerLoad, now: float | None = None) -> None:
        """The worker's latest report; with `now`, a report whose timestamp changed is noted as
        heard at `now` (`WorkerState.reported_at`)."""
        i = self._pos.get(load.worker_id)
        if i is None:
            raise KeyError(f"unknown worker {load.worker_id!r}: add_worker() it first")
        state = self._states[i]
        if now is not None and (state.reported_at is None or load.timestamp != state.load.timestamp):
            state.reported_at = now
        state.load = load
        state.routed = None
        self._write(i)

    def add_routed(self, worker_id: str, prefill_tokens: int, request_id: str | None = None) -> None:
        """Count a request just routed to the worker in its load (one more waiting request,
        `prefill_tokens` more queued) until its next report, which then includes it. The report's
        timestamp is kept: this is not news from the worker. With `request_id`, `remove_routed`
        can take the count back before that report (the request ended)."""
        i = self._pos[worker_id]
        state = self._states[i]
        load = state.load
        state.load = replace(load, waiting=load.waiting + 1,
                             waiting_prefill_tokens=load.waiting_prefill_tokens + prefill_tokens)
        if request_id is not None:
            if state.routed is None:
                state.routed = {}
            state.routed[request_id] = prefill_tokens
        self._write(i)

    def remove_routed(self, worker_id: str, request_id: str) -> bool:
        """Take back `add_routed`'s count of a request that has ended, if the worker's load still
        holds it (no report since). True if it did; an unknown worker or request is ignored."""
        i = self._pos.get(worker_id)
        if i is None:
            return False
        state = self._states[i]
        if state.routed is None or request_id not in state.routed:
            return False
        tokens = state.routed.pop(request_id)
        load = state.load
        state.load = replace(load, waiting=max(load.waiting - 1, 0),
                             waiting_prefill_tokens=max(load.waiting_prefill_tokens - tokens, 0))
        self._write(i)
        return True

    def set_cap(self, worker_id: str, cap: int | None) -> None:
        i = self._pos[worker_id]
        self._states[i].cap = cap
        self._write(i)

    def set_healthy(self, worker_id: str, healthy: bool) -> None:
        i = self._pos[worker_id]
        self._states[i].healthy = healthy
        self._write(i)

    def _write(self, i: int) -> None:
        state, cols = self._states[i], self._store
        load = state.load
        healthy = state.healthy and load.healthy
        outstanding = load.running + load.waiting
        cap = math.inf if state.cap is None else state.cap
        cols.healthy[i] = healthy
        cols.outstanding[i] = outstanding
        cols.waiting_prefill_tokens[i] = load.waiting_prefill_tokens
        cols.running_decode_tokens[i] = load.running_decode_tokens
        cols.kv_usage[i] = load.kv_usage
        cols.cap[i] = cap
        cols.eligible_column[i] = healthy and outstanding < cap
        if self._orders:
            self._update_orders(i)

    def _update_orders(self, i: int) -> None:
        state = self._states[i]
        key = None
        if state.eligible:  # the same values as the columns (float64 of the load's fields)
            load = state.load
            key = LoadKey(float(load.waiting_prefill_tokens), float(load.running_decode_tokens),
                          float(load.kv_usage), float(load.running + load.waiting))
        for order in self._orders:
            order.update(state.worker_id, key)

    def columns(self) -> LoadColumns:
        """Views of the first len(self) rows (valid until the next add/remove; one object, shared by
        the calls in between: read-only for callers)."""
        if self._columns is not None:
            return self._columns
        n, s = self._n, self._store
        self._columns = LoadColumns(ids=s.ids, healthy=s.healthy[:n], outstanding=s.outstanding[:n],
                           waiting_prefill_tokens=s.waiting_prefill_tokens[:n],
                           running_decode_tokens=s.running_decode_tokens[:n],
                           kv_usage=s.kv_usage[:n], cap=s.cap[:n], pos=self._pos,
                           id_array=self._id_array[:n], eligible_column=s.eligible_column[:n])
        return self._columns
