"""The cluster's KV event log: every worker's numbered KV event batches and loads, in one ordered
stream that any number of router copies consume.

Workers publish here (`publish`, `publish_snapshot`, `update_load`); each router copy long-polls
`poll(instance, cursor)` and gets what was appended after its cursor. The log keeps a mirror of each
worker's cached block set, so a router copy that is late (its cursor fell off the bounded log), new,
or talking to a restarted hub (another `instance`) gets a snapshot of every worker instead and goes
on from there. A worker whose batch does not follow its last one (a lost batch, a restarted hub) is
told to send a snapshot. Plain Python, no Ray: the hub actor (cluster/event_hub.py) wraps it, and
the simulator's router copies (router/sim/copies.py) use it as is.

Order: the log is the consumer of the workers' publications, and `publish` is the one place that
orders them by (epoch, seq) for the stream; each router copy's KVIndex (router/index.py) is the one
place that orders the stream's batches for that copy.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from kvmesh.protocol import AllCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot, WorkerLoad


@dataclass
class WorkerGone:
    """Log entry: the worker left the cluster (died or was scaled down)."""
    worker_id: str


@dataclass
class PollResult:
    instance: str
    cursor: int  # pass back on the next poll
    entries: list  # KVEventBatch | KVSnapshot | WorkerGone, in log order
    loads: dict[str, WorkerLoad]  # every known worker's latest report
    resync: bool = False  # entries are one snapshot per live worker (the cursor was invalid)


@dataclass
class _Worker:
    epoch: int
    seq: int  # last applied batch
    block_size: int
    blocks: set[int] = field(default_factory=set)
    load: WorkerLoad | None = None
    stats: dict = field(default_factory=dict)
    last_seen: float = 0.0


class EventLog:
    def __init__(self, max_entries: int = 50_000, clock=time.monotonic):
        self.instance = uuid.uuid4().hex
        self.max_entries = max_entries
        self.clock = clock
        self.head = 0  # cursor of the newest entry
        self._entries: deque[tuple[int, object]] = deque()
        self._workers: dict[str, _Worker] = {}

    # ---- workers' side -----------------------------------------------------------------------

    def publish(self, batch: KVEventBatch, block_size: int = 16) -> bool:
        """Append a batch; False when it does not follow the worker's last one (send a snapshot)."""
        w = self._workers.get(batch.worker_id)
        if w is None or w.epoch != batch.epoch:
            if batch.seq != 0:
                return False
            # A new epoch from its first batch: the worker (re)started with an empty cache.
            self._reset(KVSnapshot(batch.worker_id, batch.epoch, -1, [], block_size))
            w = self._workers[batch.worker_id]
        elif batch.seq <= w.seq:
            return True  # already covered by a snapshot
        elif batch.seq != w.seq + 1:
            return False
        for event in batch.events:
            if isinstance(event, BlockStored):
                w.blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                w.blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllCleared):
                w.blocks.clear()
        w.seq = batch.seq
        w.last_seen = self.clock()
        self._append(batch)
        return True

    def publish_snapshot(self, snap: KVSnapshot) -> None:
        self._reset(snap)

    def update_load(self, load: WorkerLoad, stats: dict | None = None) -> bool:
        """False for a worker this log does not know (it must send a snapshot first)."""
        w = self._workers.get(load.worker_id)
        if w is None:
            return False  # loads of a worker start with its first batch or snapshot
        w.load = load
        if stats is not None:
            w.stats = stats
        w.last_seen = self.clock()
        return True

    def remove_worker(self, worker_id: str) -> bool:
        if self._workers.pop(worker_id, None) is None:
            return False
        self._append(WorkerGone(worker_id))
        return True

    def remove_silent(self, max_silence_s: float) -> list[str]:
        """Drop workers that published nothing for max_silence_s (they died without a goodbye)."""
        now = self.clock()
        gone = [wid for wid, w in self._workers.items() if now - w.last_seen > max_silence_s]
        for wid in gone:
            self.remove_worker(wid)
        return gone

    # ---- routers' side -----------------------------------------------------------------------

    def snapshot(self, worker_id: str) -> KVSnapshot | None:
        w = self._workers.get(worker_id)
        if w is None:
            return None
        return KVSnapshot(worker_id, w.epoch, w.seq, sorted(w.blocks), w.block_size)

    def poll(self, instance: str | None, cursor: int) -> PollResult:
        oldest = self._entries[0][0] if self._entries else self.head + 1
        if instance != self.instance or cursor > self.head or cursor < oldest - 1:
            entries = [self.snapshot(wid) for wid in self._workers]
            return self._result(entries, resync=True)
        # Entries are numbered consecutively, so the first one after `cursor` is at this offset.
        start = cursor + 1 - oldest
        entries = [item for _, item in list(self._entries)[start:]]
        return self._result(entries)

    def has_after(self, cursor: int) -> bool:
        return self.head > cursor

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def loads(self) -> dict[str, WorkerLoad]:
        return {wid: w.load for wid, w in self._workers.items() if w.load is not None}

    def stats(self) -> dict[str, dict]:
        """Worker -> its counters (prompt / cached tokens, steps, ...), for /metrics and `kvmesh
        status` through the hub; router copies do not route on them and are not sent them."""
        return {wid: dict(w.stats) for wid, w in self._workers.items()}

    # ---- internals ---------------------------------------------------------------------------

    def _reset(self, snap: KVSnapshot) -> None:
        old = self._workers.get(snap.worker_id)
        w = _Worker(snap.epoch, snap.seq, snap.block_size, set(snap.block_hashes),
                    old.load if old else None, old.stats if old else {}, self.clock())
        self._workers[snap.worker_id] = w
        self._append(KVSnapshot(snap.worker_id, snap.epoch, snap.seq, sorted(w.blocks), snap.block_size))

    def _append(self, item) -> None:
        self.head += 1
        self._entries.append((self.head, item))
        while len(self._entries) > self.max_entries:
            self._entries.popleft()

    def _result(self, entries, resync: bool = False) -> PollResult:
        return PollResult(self.instance, self.head, entries, self.loads(), resync)
