"""KV index: block hash -> the workers that hold it, built only from the workers' KV events.

Each worker's events arrive as numbered batches (`KVEventBatch(worker_id, epoch, seq, events)`).
The index applies a batch only when it is the next one of the worker's current epoch; a gap or a new
epoch (the worker restarted) means the index no longer knows that worker's cache, so it drops what it
had for it and asks for a snapshot (`apply` returns False) instead of guessing. Batches that arrive
while the snapshot is on its way are kept (bounded) and replayed after it.

Memory is bounded by `max_blocks` distinct hashes: when full, the least recently stored hash is dropped
(for every worker that held it). A hash maps to a bitmask of worker slots (one Python int), which keeps
an entry small even at 1024 workers, and each worker keeps the set of its hashes so that removing it
costs O(its blocks). Not thread-safe: `Router` holds the lock.
"""

import sys
from itertools import groupby, repeat, takewhile
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.protocol import AllCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot

MAX_PENDING_BATCHES = 1024  # batches kept per worker while its snapshot is awaited


@dataclass
class _WorkerEntry:
    slot: int  # bit position in the block masks
    epoch: int | None = None
    next_seq: int = 0
    awaiting_snapshot: bool = True  # unknown cache until its first batch 0 or a snapshot
    snapshot_requested: bool = False
    blocks: set[int] = field(default_factory=set)
    pending: list[KVEventBatch] = field(default_factory=list)


class KVIndex:
    """Block hash -> workers, fed by `apply(batch)` / `apply_snapshot(snap)`.

    - `apply(batch) -> bool`: False when the batch shows a gap or a new epoch: the caller must fetch a
      snapshot of that worker and pass it to `apply_snapshot`. Until then that worker counts as
      holding nothing, and its later batches are buffered (True is returned for them).
    - `overlap(block_hashes, worker_ids=None) -> {worker_id: leading cached blocks}` (workers with 0
      are left out).
    - `remove_worker(worker_id)`: forget a worker, O(its blocks).
    """

    def __init__(self, max_blocks: int = 1_000_000):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, int] = OrderedDict()  # hash -> worker-slot bitmask, LRU order
        self._workers: dict[str, _WorkerEntry] = {}
        self._slot_owner: list[str | None] = []  # slot -> worker id
        self._free_slots: list[int] = []
        self._all_mask = 0  # bits of every registered worker
        self.num_evicted = 0  # hashes dropped to stay within max_blocks
        self.num_resyncs = 0  # gaps / new epochs seen

    # ---- workers -----------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        """Register a worker (done implicitly by its first batch or snapshot)."""
        self._entry(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        entry = self._workers.pop(worker_id, None)
        if entry is None:
            return
        self._drop_blocks(entry)
        self._slot_owner[entry.slot] = None
        self._free_slots.append(entry.slot)
        self._all_mask &= ~(1 << entry.slot)

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def awaiting_snapshot(self, worker_id: str) -> bool:
        entry = self._workers.get(worker_id)
        return entry is None or entry.awaiting_snapshot

    def workers_awaiting_snapshot(self) -> list[str]:
        """Workers whose snapshot was asked for (by a False from apply) and has not arrived."""
        return [wid for wid, e in self._workers.items() if e.awaiting_snapshot and e.snapshot_requested]

    def worker_blocks(self, worker_id: str) -> set[int]:
        entry = self._workers.get(worker_id)
        return set(entry.blocks) if entry else set()

    # ---- events ------------------------------------------------------------------------------

    def apply(self, batch: KVEventBatch) -> bool:
        entry = self._entry(batch.worker_id)
        if entry.awaiting_snapshot:
            if entry.epoch is None and batch.seq == 0 and not entry.snapshot_requested:
                # A worker seen from its very first batch: it started empty, nothing to fetch.
                entry.epoch, entry.awaiting_snapshot = batch.epoch, False
            else:
                if len(entry.pending) < MAX_PENDING_BATCHES:
                    entry.pending.append(batch)
                if entry.snapshot_requested:
                    return True
                entry.snapshot_requested = True
                self.num_resyncs += 1
                return False
        elif batch.epoch != entry.epoch or batch.seq > entry.next_seq:
            self._start_resync(entry, batch)
            return False
        elif batch.seq < entry.next_seq:
            return True  # already covered (a duplicate, or older than the snapshot)
        self._apply_events(entry, batch)
        return True

    def apply_snapshot(self, snap: KVSnapshot) -> bool:
        """Replace what the index holds for `snap.worker_id`; continue from batch `snap.seq + 1`.
        Returns False if the batches buffered meanwhile still leave a gap (fetch a newer snapshot)."""
        entry = self._entry(snap.worker_id)
        self._drop_blocks(entry)
        entry.epoch, entry.next_seq = snap.epoch, snap.seq + 1
        entry.awaiting_snapshot = entry.snapshot_requested = False
        self._store(entry, snap.block_hashes)
        pending = sorted((b for b in entry.pending if b.epoch == snap.epoch and b.seq > snap.seq),
                         key=lambda b: b.seq)
        entry.pending = []
        for i, batch in enumerate(pending):
            if batch.seq > entry.next_seq:
                # Still a gap after the snapshot: ask for a newer one, keep what came after it.
                self._start_resync(entry, batch)
                entry.pending = pending[i:]
                return False
            if batch.seq == entry.next_seq:
                self._apply_events(entry, batch)
        return True

    def _start_resync(self, entry: _WorkerEntry, batch: KVEventBatch) -> None:
        self.num_resyncs += 1
        self._drop_blocks(entry)
        entry.awaiting_snapshot = entry.snapshot_requested = True
        entry.pending = [batch]

    def _apply_events(self, entry: _WorkerEntry, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(entry, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(entry, event.block_hashes)
            elif isinstance(event, AllCleared):
                self._drop_blocks(entry)
            else:
                raise TypeError(f"unknown KV event {type(event).__name__}")
        entry.next_seq = batch.seq + 1

    def _store(self, entry: _WorkerEntry, hashes: Iterable[int]) -> None:
        bit = 1 << entry.slot
        blocks, mine = self._blocks, entry.blocks
        # The blocks of a chain mostly have the same holders: they share one mask object (its old
        # value -> new value is computed once per run), which keeps the masks a walk reads in cache
        # and stores one 1024-bit int per run instead of one per block.
        old = new = None
        for h in hashes:
            mask = blocks.get(h)
            if mask is None:
                blocks[h] = bit
            else:
                if mask is not old:
                    old, new = mask, mask | bit
                blocks[h] = new
                blocks.move_to_end(h)
            mine.add(h)
        while len(blocks) > self.max_blocks:
            self._evict_oldest()

    def _remove(self, entry: _WorkerEntry, hashes: Iterable[int]) -> None:
        clear = ~(1 << entry.slot)
        blocks, mine = self._blocks, entry.blocks
        old = new = None  # shared masks stay shared (see _store)
        for h in hashes:
            if h in mine:
                mine.discard(h)
                mask = blocks[h]
                if mask is not old:
                    old, new = mask, mask & clear
                if new:
                    blocks[h] = new
                else:
                    del blocks[h]

    def _drop_blocks(self, entry: _WorkerEntry) -> None:
        self._remove(entry, list(entry.blocks))

    def _evict_oldest(self) -> None:
        h, mask = self._blocks.popitem(last=False)
        self.num_evicted += 1
        for slot in _bits(mask):
            self._workers[self._slot_owner[slot]].blocks.discard(h)

    def _entry(self, worker_id: str) -> _WorkerEntry:
        entry = self._workers.get(worker_id)
        if entry is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_owner[slot] = worker_id
            else:
                slot = len(self._slot_owner)
                self._slot_owner.append(worker_id)
            entry = self._workers[worker_id] = _WorkerEntry(slot=slot)
            self._all_mask |= 1 << slot
        return entry

    # ---- queries -----------------------------------------------------------------------------

    def overlap(self, block_hashes: Sequence[int],
                worker_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Number of leading blocks of `block_hashes` each worker holds; workers with none are left
        out. `worker_ids` restricts the answer to those workers."""
        if worker_ids is None:
            alive = self._all_mask
        else:
            alive = 0
            for wid in worker_ids:
                entry = self._workers.get(wid)
                if entry is not None:
                    alive |= 1 << entry.slot
        if not alive or not block_hashes:
            return {}
        # The lookups run in C (map, takewhile) and stop at the first block no worker holds. Then the
        # walk goes by runs of one mask, not block by block: a chain's blocks share their mask
        # object (see _store), so groupby's comparisons are identity checks, and the holder set can
        # only shrink at a run's boundary (a worker missing block i cannot count blocks after it).
        masks = list(takewhile(bool, map(self._blocks.get, block_hashes, repeat(0, len(block_hashes)))))
        result: dict[str, int] = {}
        if not masks:
            return result
        owner = self._slot_owner
        running, num_leading = alive, 0  # workers holding every block so far; blocks so far
        for mask, run in groupby(masks):
            held = running & mask
            if held != running:
                if num_leading:  # workers that held blocks 0..num_leading-1 but not this run
                    for slot in _bits(running & ~held):
                        result[owner[slot]] = num_leading
                running = held
                if not running:
                    return result
            num_leading += len(list(run))
        for slot in _bits(running):
            result[owner[slot]] = num_leading
        return result

    def holders(self, block_hash: int) -> list[str]:
        return [self._slot_owner[s] for s in _bits(self._blocks.get(block_hash, 0))]

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held (by any worker)."""
        return len(self._blocks)

    def approx_bytes(self) -> int:
        """Memory the index holds, from sys.getsizeof of its containers and entries (O(blocks))."""
        total = sys.getsizeof(self._blocks)  # includes the OrderedDict's linked-list nodes
        masks: dict[int, int] = {}  # id -> size: a mask object shared by many blocks counts once
        for h, mask in self._blocks.items():
            total += sys.getsizeof(h)
            if mask > 255:  # small ints are shared by the interpreter
                masks[id(mask)] = sys.getsizeof(mask)
        total += sum(masks.values())
        for entry in self._workers.values():
            total += sys.getsizeof(entry.blocks) + sys.getsizeof(entry)
        return total


def _bits(mask: int):
    """Positions of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
