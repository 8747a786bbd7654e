"""A simulated worker's KV block pool with prefix caching, emitting the block manager's events.

Same rules as the engine's block manager: a fixed pool of blocks; full blocks are cached under their
chained hash, reference-counted while requests use them; freed cached blocks stay in an LRU (a hit
revives them) until their slot is reused, which emits `BlockRemoved`; a newly full cached block emits
`BlockStored` in chain order; a request's blocks are freed last block first, so a prefix outlives its
tails. Two simplifications: a request reserves blocks for its prompt and its whole output at admission
(no preemption), and output blocks are hashed when the request finishes.
"""

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.protocol import BlockRemoved, BlockStored, KVEvent


class SimKVCache:
    def __init__(self, capacity_blocks: int, block_size: int):
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.refs: dict[int, int] = {}  # cached blocks in use -> reference count
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # cached, unused; evict from the front
        self.private = 0  # in-use blocks without a hash (partial, not yet computed, duplicates)
        self.events: list[KVEvent] = []  # since the last take_events()

    @property
    def num_free(self) -> int:
        """Blocks a new request may take (blank ones plus evictable cached ones)."""
        return self.capacity - len(self.refs) - self.private

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.capacity

    def match(self, hashes: Sequence[int], max_blocks: int) -> int:
        """Leading blocks of `hashes` that are cached (in use or free), at most `max_blocks`."""
        n = 0
        refs, free = self.refs, self.free_cached
        for h in hashes:
            if n >= max_blocks or (h not in refs and h not in free):
                break
            n += 1
        return n

    def allocate(self, hit_hashes: Sequence[int], num_new_blocks: int) -> bool:
        """Pin the cached `hit_hashes` and reserve `num_new_blocks` more; False if they don't fit."""
        revived = sum(1 for h in hit_hashes if h not in self.refs)
        if self.num_free - revived < num_new_blocks:
            return False
        for h in hit_hashes:
            count = self.refs.get(h)
            if count is None:
                del self.free_cached[h]
                self.refs[h] = 1
            else:
                self.refs[h] = count + 1
        blank = self.capacity - len(self.refs) - self.private - len(self.free_cached)
        if blank < num_new_blocks:
            evicted = [self.free_cached.popitem(last=False)[0] for _ in range(num_new_blocks - blank)]
            self.events.append(BlockRemoved(block_hashes=evicted))
        self.private += num_new_blocks
        return True

    def commit(self, hashes: Sequence[int], parent_hash: int | None) -> list[int]:
        """Newly computed full blocks (private so far) become cached under `hashes`; a hash already
        cached keeps its block and ours stays a private duplicate. Like the block manager, emits one
        BlockStored per contiguous run of newly cached blocks, with the hash before the run as its
        parent. Returns the hashes now held."""
        stored, run = [], []
        run_parent = previous = parent_hash
        for h in hashes:
            if h in self.refs or h in self.free_cached:
                self._emit_stored(run, run_parent)
                run = []
            else:
                self.refs[h] = 1
                self.private -= 1
                stored.append(h)
                if not run:
                    run_parent = previous
                run.append(h)
            previous = h
        self._emit_stored(run, run_parent)
        return stored

    def _emit_stored(self, run: list[int], parent_hash: int | None) -> None:
        if run:
            self.events.append(BlockStored(block_hashes=run, parent_hash=parent_hash,
                                           num_tokens=len(run) * self.block_size))

    def release(self, held: Sequence[int], num_private: int) -> None:
        """Free a finished request's blocks: cached ones to the LRU, last block first."""
        for h in reversed(held):
            count = self.refs[h] - 1
            if count:
                self.refs[h] = count
            else:
                del self.refs[h]
                self.free_cached[h] = None
        self.private -= num_private

    def cached_hashes(self) -> list[int]:
        return list(self.refs) + list(self.free_cached)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
