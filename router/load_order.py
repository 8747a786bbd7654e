"""The eligible workers in order of a load cost, kept up to date as loads change, so that a policy finds
the least loaded workers without a pass over all of them.

A policy's cost of a worker is a part that depends on the request (its cached prefix) plus a part
that depends only on the worker's load. Workers that hold none of a request's prefix differ only in
the second, so the cheapest of them is the first in load order: the kv_events policy scores the
holders of the prompt's blocks exactly and takes the best of the others from here.

Workers with the same load components (`LoadKey`) share a bucket, whose cost is computed once; the
buckets sit in a heap by cost. Each update is O(log buckets) (a bucket's entry is pushed when it
fills; an emptied one is dropped when it reaches the top, and the heap is rebuilt when dead entries
outnumber live ones). Idle workers all share one bucket, so a cold cluster's thousand tied workers
cost one entry, and a uniform pick among them is O(excluded) (`pick`).
"""

import heapq
from collections.abc import Callable, Collection
from typing import NamedTuple


class LoadKey(NamedTuple):
    """What a worker's load cost depends on (the LoadColumns of one row)."""
    waiting_prefill_tokens: float
    running_decode_tokens: float
    kv_usage: float
    outstanding: float


class Bucket(NamedTuple):
    cost: float  # the load cost of every member
    key: LoadKey
    members: list[str]  # worker ids


class LoadOrder:
    def __init__(self, load_cost: Callable[[LoadKey], float]):
        self.load_cost = load_cost
        self._key_of: dict[str, LoadKey] = {}
        self._buckets: dict[LoadKey, list[str]] = {}  # non-empty ones only
        self._slot: dict[str, int] = {}  # worker -> its index in its bucket's list
        self._heap: list[tuple[float, LoadKey]] = []  # (cost, key), one entry per key in _queued
        self._queued: set[LoadKey] = set()

    def __len__(self) -> int:
        """Eligible workers."""
        return len(self._key_of)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._key_of

    def key_of(self, worker_id: str) -> LoadKey | None:
        return self._key_of.get(worker_id)

    def update(self, worker_id: str, key: LoadKey | None) -> None:
        """The worker's load components, or None when it is not eligible (unhealthy, at its cap)."""
        old = self._key_of.get(worker_id)
        if old == key:
            return
        if old is not None:
            self._leave(worker_id, old)
        if key is not None:
            self._join(worker_id, key)

    def discard(self, worker_id: str) -> None:
        self.update(worker_id, None)

    def _join(self, worker_id: str, key: LoadKey) -> None:
        self._key_of[worker_id] = key
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = []
            if key not in self._queued:
                self._queued.add(key)
                heapq.heappush(self._heap, (self.load_cost(key), key))
                if len(self._heap) > 2 * len(self._buckets) + 64:
                    self._rebuild()
        self._slot[worker_id] = len(bucket)
        bucket.append(worker_id)

    def _leave(self, worker_id: str, key: LoadKey) -> None:
        del self._key_of[worker_id]
        bucket = self._buckets[key]
        i = self._slot.pop(worker_id)
        last = bucket.pop()
        if last != worker_id:  # the last member takes the freed place
            bucket[i] = last
            self._slot[last] = i
        if not bucket:
            del self._buckets[key]  # its heap entry goes when it reaches the top

    def _rebuild(self) -> None:
        self._heap = [(self.load_cost(key), key) for key in self._buckets]
        heapq.heapify(self._heap)
        self._queued = set(self._buckets)

    def cheapest(self, excluded: Collection[str] = (), slack: float = 0.0) -> list[tuple[Bucket, int]]:
        """The buckets in cost order from the first that has a member outside `excluded`, through
        every bucket within `slack` of its cost, each with its number of members outside `excluded`
        (buckets of excluded workers only are skipped); [] when every eligible worker is excluded.
        O((buckets skipped + returned) log buckets + excluded)."""
        heap, found, popped = self._heap, [], []
        first_cost = None
        num_excluded: dict[LoadKey, int] = {}
        for w in excluded:
            key = self._key_of.get(w)
            if key is not None:
                num_excluded[key] = num_excluded.get(key, 0) + 1
        while heap:
            cost, key = heap[0]
            bucket = self._buckets.get(key)
            if bucket is None:  # emptied since it was pushed
                heapq.heappop(heap)
                self._queued.discard(key)
                continue
            if first_cost is not None and cost > first_cost + slack:
                break
            popped.append(heapq.heappop(heap))
            outside = len(bucket) - num_excluded.get(key, 0)
            if outside:
                found.append((Bucket(cost, key, bucket), outside))
                if first_cost is None:
                    first_cost = cost
        for entry in popped:
            heapq.heappush(heap, entry)
        return found

    def pick(self, bucket: Bucket, index: int, excluded: Collection[str] = ()) -> str:
        """The `index`-th member of `bucket` outside `excluded` (in the bucket's order)."""
        skipped = sorted(self._slot[w] for w in excluded if self._key_of.get(w) == bucket.key)
        for slot in skipped:
            if slot <= index:
                index += 1
            else:
                break
        return bucket.members[index]
