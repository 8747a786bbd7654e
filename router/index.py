"""KV index: block hash -> the workers that hold it, built only from the workers' KV events.

Each worker's events arrive as numbered batches (`KVEventBatch(worker_id, epoch, seq, events)`).
The index applies a batch only when it is the next one of the worker's current epoch; a gap or a new
epoch (the worker restarted) means the index no longer knows that worker's cache, so it drops what it
had for it and asks for a snapshot (`apply` returns False) instead of guessing. Batches that arrive
while the snapshot is on its way are kept (bounded) and replayed after it.

Memory is bounded by `max_blocks` distinct hashes: when full, the least recently stored hash is dropped
(for every worker that held it). A hash maps to its *run*: the blocks stored together that have the
same holders, with one bitmask of worker slots (a Python int) for all of them, which keeps an entry
small even at 1024 workers. A store or removal that covers part of a run splits it, so a lookup
answers for a whole stretch of a prompt: `overlap` costs a dict lookup per run, not per block. Each
worker keeps the set of its hashes so that removing it costs O(its blocks). Not thread-safe: `Router`
holds the lock.
"""

import sys
from array import array
from itertools import groupby
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvmesh.hashing import hash_array
from kvmesh.protocol import AllCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot

MAX_PENDING_BATCHES = 1024  # batches kept per worker while its snapshot is awaited
# bit_positions: up to CLEAR_LOWEST_BITS set bits by clearing the lowest, up to BIN_FIND_BITS by
# finding them in the binary text, then by numpy
CLEAR_LOWEST_BITS = 16
BIN_FIND_BITS = 128


@dataclass
class _WorkerEntry:
    slot: int  # bit position in the block masks
    epoch: int | None = None
    next_seq: int = 0
    awaiting_snapshot: bool = True  # unknown cache until its first batch 0 or a snapshot
    snapshot_requested: bool = False
    blocks: set[int] = field(default_factory=set)
    pending: list[KVEventBatch] = field(default_factory=list)


class _Run:
    """Blocks that have the same holders (`mask`, a bitmask of worker slots), in the order they were
    stored: a chain segment when they came from one event. Every hash of `hashes` maps to this run in
    the index, so a walk that finds a prompt's next blocks equal to a run's hashes knows their
    holders from one lookup. The hashes are an array('Q'), whose hashes the garbage collector does
    not visit (a list of a chain's hundreds of hashes would cost a young collection a visit each)."""
    __slots__ = ("mask", "hashes")

    def __init__(self, mask: int, hashes: array):
        self.mask = mask
        self.hashes = hashes


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
        self._blocks: OrderedDict[int, _Run] = OrderedDict()  # hash -> its run, LRU order
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
        self._store(entry, snap.block_hashes, as_chain=False)
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
                self._store(entry, event.block_hashes, parent_hash=event.parent_hash)
            elif isinstance(event, BlockRemoved):
                self._remove(entry, event.block_hashes)
            elif isinstance(event, AllCleared):
                self._drop_blocks(entry)
            else:
                raise TypeError(f"unknown KV event {type(event).__name__}")
        entry.next_seq = batch.seq + 1

    def _store(self, entry: _WorkerEntry, hashes: Iterable[int], as_chain: bool = True,
               parent_hash: int | None = None) -> None:
        """Set the worker's bit on `hashes` (most recently stored). New hashes that follow each other
        form one run (`as_chain`: they are a chain segment, as an event's are, `parent_hash` the block
        before the first; a snapshot's sorted hashes are not, so each becomes its own run). New
        hashes that follow the last block of a run held by this worker alone extend that run: a
        conversation's turns, stored by one worker in an event each, stay one run, which a walk
        crosses with one lookup instead of one per turn."""
        bit = 1 << entry.slot
        blocks, mine = self._blocks, entry.blocks
        fresh = None  # the run new hashes are appended to
        seg_run, segment = None, []  # consecutive hashes of one existing run
        previous = parent_hash  # the block before h in the chain
        for h in hashes:
            run = blocks.get(h)
            if run is None:
                if not as_chain:
                    fresh = _Run(bit, array("Q"))
                elif fresh is None:
                    before = None if previous is None else blocks.get(previous)
                    if before is not None and before.mask == bit and before.hashes[-1] == previous:
                        fresh = before
                    else:
                        fresh = _Run(bit, array("Q"))
                fresh.hashes.append(h)
                blocks[h] = fresh
            else:
                fresh = None
                blocks.move_to_end(h)
                if not run.mask & bit:
                    if run is not seg_run and segment:
                        self._set_mask(seg_run, segment, seg_run.mask | bit)
                        segment = []
                    seg_run = run
                    segment.append(h)
            mine.add(h)
            previous = h
        if segment:
            self._set_mask(seg_run, segment, seg_run.mask | bit)
        while len(blocks) > self.max_blocks:
            self._evict_oldest()

    def _remove(self, entry: _WorkerEntry, hashes: Iterable[int]) -> None:
        clear = ~(1 << entry.slot)
        blocks, mine = self._blocks, entry.blocks
        by_run: dict[int, tuple[_Run, list[int]]] = {}
        for h in hashes:
            if h in mine:
                mine.discard(h)
                run = blocks[h]
                by_run.setdefault(id(run), (run, []))[1].append(h)
        for run, removed in by_run.values():
            self._set_mask(run, removed, run.mask & clear)

    def _drop_blocks(self, entry: _WorkerEntry) -> None:
        self._remove(entry, list(entry.blocks))

    def _set_mask(self, run: _Run, subset: Sequence[int], mask: int) -> None:
        """Give `subset` (hashes of `run`) the holders `mask`: the run is split where membership
        changes (the longest piece keeps the run object, the others' entries are re-pointed); a piece
        nobody holds leaves the index."""
        pieces = _pieces(run.hashes, subset)
        old_mask = run.mask
        kept = max((hashes for hashes, inside in pieces if not inside or mask), key=len, default=None)
        blocks = self._blocks
        for hashes, inside in pieces:
            piece_mask = mask if inside else old_mask
            if not piece_mask:
                for h in hashes:
                    del blocks[h]
            elif hashes is kept:
                run.hashes, run.mask = hashes, piece_mask
            else:
                piece = _Run(piece_mask, hashes)
                for h in hashes:
                    blocks[h] = piece

    def _evict_oldest(self) -> None:
        h = next(iter(self._blocks))
        run = self._blocks[h]
        self.num_evicted += 1
        for slot in _bits(run.mask):
            self._workers[self._slot_owner[slot]].blocks.discard(h)
        self._set_mask(run, [h], 0)

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
        out. `worker_ids` restricts the answer to those workers. In `levels` order (fewest blocks
        first, then by slot)."""
        if worker_ids is None:
            alive = self._all_mask
        else:
            alive = 0
            for wid in worker_ids:
                entry = self._workers.get(wid)
                if entry is not None:
                    alive |= 1 << entry.slot
        owner = self._slot_owner
        result: dict[str, int] = {}
        for num_blocks, mask in self.levels(block_hashes, alive):
            for slot in bit_positions(mask):
                result[owner[slot]] = num_blocks
        return result

    def levels(self, block_hashes: Sequence[int], alive: int | None = None) -> list[tuple[int, int]]:
        """The holders of the prompt's prefixes by length: [(num_blocks, mask)], num_blocks ascending
        (each >= 1), `mask` the slots (`slot`, `worker_at`) of the workers whose leading cached
        blocks of `block_hashes` number exactly `num_blocks`. `block_hashes`: best an array('Q')
        (kvmesh.hashing.hash_array), as the runs keep theirs; any other sequence is converted first
        (~40 ns a hash). The masks are disjoint and one entry
        stands for every worker at that length, so the answer grows with the number of distinct
        lengths, not with the holders (a system prompt on every worker is one entry). `alive`: only
        these slots (default every worker's). O(prompt runs)."""
        if alive is None:
            alive = self._all_mask
        if not alive or not block_hashes:
            return []
        # The walk goes run by run: one lookup finds a block's run, whose hashes the prompt's next
        # blocks are compared to in C (a chain's blocks stored together form one run), so a prompt
        # costs a lookup per run, not per block. The holder set can only shrink at a run's boundary
        # (a worker missing block i cannot count blocks after it).
        block_hashes = hash_array(block_hashes)
        get = self._blocks.get
        levels: list[tuple[int, int]] = []
        running, num_leading = alive, 0  # workers holding every block so far; blocks so far
        num_hashes = len(block_hashes)
        while num_leading < num_hashes:
            run = get(block_hashes[num_leading])
            if run is None:
                break
            held = running & run.mask
            if held != running:
                if num_leading:  # workers that held blocks 0..num_leading-1 but not this run
                    levels.append((num_leading, running ^ held))
                running = held
                if not running:
                    return levels
            num_leading += _run_length(run.hashes, block_hashes, num_leading)
        if num_leading and running:
            levels.append((num_leading, running))
        return levels

    def slot(self, worker_id: str) -> int:
        """The worker's bit position in the masks of `levels` (a new worker is registered, as by
        add_worker). A slot is reused only after remove_worker."""
        return self._entry(worker_id).slot

    def worker_at(self, slot: int) -> str | None:
        return self._slot_owner[slot] if slot < len(self._slot_owner) else None

    def holders(self, block_hash: int) -> list[str]:
        run = self._blocks.get(block_hash)
        return [] if run is None else [self._slot_owner[s] for s in _bits(run.mask)]

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held (by any worker)."""
        return len(self._blocks)

    def approx_bytes(self) -> int:
        """Memory the index holds, from sys.getsizeof of its containers and entries (O(blocks))."""
        total = sys.getsizeof(self._blocks)  # includes the OrderedDict's linked-list nodes
        runs: dict[int, int] = {}  # id -> size: a run shared by many blocks counts once
        for h, run in self._blocks.items():
            total += sys.getsizeof(h)
            if id(run) not in runs:
                mask_bytes = sys.getsizeof(run.mask) if run.mask > 255 else 0  # small ints are shared
                runs[id(run)] = sys.getsizeof(run) + sys.getsizeof(run.hashes) + mask_bytes
        total += sum(runs.values())
        for entry in self._workers.values():
            total += sys.getsizeof(entry.blocks) + sys.getsizeof(entry)
        return total


def _pieces(hashes: array, subset: Sequence[int]) -> list[tuple[array, bool]]:
    """`hashes` (no repeats) cut into maximal stretches inside / outside `subset` (some of them), in
    order. A subset that is one stretch starting at its first element (an event's chain segment, an
    evicted block) is cut by slicing; any other by one pass."""
    members = set(subset)
    if len(members) == len(hashes):
        return [(hashes, True)]
    start = hashes.index(subset[0])
    stop = start + len(members)
    stretch = hashes[start:stop]
    if len(stretch) == len(members) and members.issuperset(stretch):
        cut = [(hashes[:start], False), (stretch, True), (hashes[stop:], False)]
        return [piece for piece in cut if piece[0]]
    return [(array("Q", run), inside) for inside, run in groupby(hashes, members.__contains__)]


def _run_length(run_hashes: array, block_hashes: array, start: int) -> int:
    """How many blocks of `block_hashes` from `start` (which is in the run) are the run's next
    hashes: all of the run's rest when the prompt follows it, else the prefix they share, found by
    bisection (chained hashes that agree at block k agree before it) and checked; 1 when the prompt
    enters the run past its first block (not a chain: each block is looked up alone)."""
    if run_hashes[0] != block_hashes[start]:
        return 1
    length = min(len(run_hashes), len(block_hashes) - start)
    if length == 1:
        return 1
    last = start + length - 1
    if block_hashes[last] != run_hashes[length - 1]:
        lo, hi = 1, length - 1  # blocks [start, start + lo) agree; beyond start + hi they differ
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if block_hashes[start + mid - 1] == run_hashes[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        length = lo
    stretch = run_hashes if length == len(run_hashes) else run_hashes[:length]
    return length if block_hashes[start:start + length] == stretch else 1


def _bits(mask: int):
    """Positions of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def bit_positions(mask: int) -> list[int]:
    """Positions of the set bits of `mask` (>= 0), lowest first. A few by clearing the lowest (each
    step copies the int: ~0.25 us a bit on a 4,096-bit mask); up to BIN_FIND_BITS by finding
    the '1's of its binary text (str.find runs in C; no numpy, whose code is cold in cache between
    decisions: a listed mask's load order took 97 us at p99 inside the run with numpy here, 56
    without); past that, numpy unpacks the bytes (~3.5 us warm)."""
    count = mask.bit_count()
    if count <= CLEAR_LOWEST_BITS:
        return list(_bits(mask))
    if count <= BIN_FIND_BITS:
        text = bin(mask)[:1:-1]  # lowest bit first
        find = text.find
        positions = []
        i = find("1")
        while i >= 0:
            positions.append(i)
            i = find("1", i + 1)
        return positions
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
    # nonzero on a bool view: 6x faster than on the uint8 bits (numpy 2.x, 4,096 bits: ~1.3 us)
    return np.unpackbits(raw, bitorder="little").view(bool).nonzero()[0].tolist()
