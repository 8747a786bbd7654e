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

Given `slot_of` (the KV index's slot of a worker, `KVIndex.slot`), each bucket also keeps its members
as a bitmask of those slots, and `mask` is every eligible worker's: the policy then asks for the
cheapest members of a set of workers given as a mask (the index's holder levels), `cheapest_in`,
without listing the set.
"""

import heapq
import math
from collections.abc import Callable, Collection
from typing import NamedTuple

import numpy as np

from kvmesh.router.index import bit_positions

# How the cheapest members of a mask are found (cheapest_in): a mask of at most LIST_MEMBERS workers by
# listing them (~0.4 us each); any other by walking the heap from its top, whose first buckets hold
# one of them unless they are the busy ones (a popular prefix's holders): a mask of at least
# 1/WALK_SHARE of the eligible workers for up to WALK_BUCKETS buckets, a smaller one for its first
# member up to WALK_FIRST_BUCKETS, when one is in the heap's first three entries (multiturn's workers
# without the system prompt, ~150 of 4,096, are idle: the first or second bucket), then by a
# vectorized scan of the members' load costs (~12 us at 4,096 workers warm, 25-45 us inside a run,
# whatever the members).
LIST_MEMBERS = 16
WALK_SHARE = 8
WALK_BUCKETS = 16
WALK_FIRST_BUCKETS = 4


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


class Group(NamedTuple):
    """The members of a set of workers in one bucket: the same load, so the same cost."""
    cost: float  # the bucket's load cost
    key: LoadKey
    mask: int  # the members' slot bits


class LoadOrder:
    def __init__(self, load_cost: Callable[[LoadKey], float],
                 slot_of: Callable[[str], int] | None = None):
        """`slot_of`: the bit of a worker in the masks (kept only when given)."""
        self.load_cost = load_cost
        self.slot_of = slot_of
        self.mask = 0  # bits of every eligible worker (with slot_of)
        self._bit: dict[str, int] = {}  # worker -> its bit, as slot_of said when it joined
        self._by_slot: dict[int, str] = {}  # slot -> eligible worker
        self._bucket_mask: dict[LoadKey, int] = {}  # key -> its members' bits
        self._cost: dict[LoadKey, float] = {}  # key -> load cost, for the non-empty buckets
        self._slot_cost = np.full(64, math.inf)  # slot -> its eligible worker's load cost, else inf
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

    def bit_of(self, worker_id: str) -> int:
        """The eligible worker's bit (1 << its slot; needs slot_of)."""
        return self._bit[worker_id]

    def worker_at(self, slot: int) -> str:
        """The eligible worker at `slot`."""
        return self._by_slot[slot]

    def update(self, worker_id: str, key: LoadKey | None) -> None:
        """The worker's load components, or None when it is not eligible (unhealthy, at its cap)."""
        old = self._key_of.get(worker_id)
        if old == key:
            return
        if old is not None:
            self._leave(worker_id, old)
        if key is not None:
            self._join(worker_id, key)
        if self.slot_of is not None:
            self._update_masks(worker_id, old, key)

    def _update_masks(self, worker_id: str, old: LoadKey | None, key: LoadKey | None) -> None:
        masks = self._bucket_mask
        if old is None:
            slot = self.slot_of(worker_id)
            bit = self._bit[worker_id] = 1 << slot
            self._by_slot[slot] = worker_id
            self.mask |= bit
        else:
            bit = self._bit[worker_id]
            left = masks[old] ^ bit
            if left:
                masks[old] = left
            else:
                del masks[old]
        slot = bit.bit_length() - 1
        if key is None:
            del self._bit[worker_id]
            del self._by_slot[slot]
            self.mask ^= bit
            self._slot_cost[slot] = math.inf
        else:
            masks[key] = masks.get(key, 0) | bit
            if slot + 8 > len(self._slot_cost):  # room for a mask's last byte (_scanned)
                grown = np.full(2 * (slot + 8), math.inf)
                grown[:len(self._slot_cost)] = self._slot_cost
                self._slot_cost = grown
            self._slot_cost[slot] = self._cost[key]

    def discard(self, worker_id: str) -> None:
        self.update(worker_id, None)

    def _join(self, worker_id: str, key: LoadKey) -> None:
        self._key_of[worker_id] = key
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = []
            self._cost[key] = self.load_cost(key)
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
            del self._cost[key]

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

    def cheapest_in(self, masks: list[int], slack: float = 0.0) -> list[list[Group]]:
        """For each of `masks` (sets of workers as slot bits; needs slot_of), the buckets holding an
        eligible member of it, in (cost, key) order -- the heap's -- from the cheapest through every
        one within `slack` of its cost, as groups (the bucket's members in the set); [] when no
        eligible worker is in the set. A set of up to LIST_MEMBERS eligible workers is listed
        (O(members)); the others share one walk of the heap from its top, which stops when each has
        its groups (a set of most workers meets one in the first buckets) or after WALK_BUCKETS
        buckets, a set of fewer than 1/WALK_SHARE of the eligible (walked only when a member is in
        the heap's first three entries) without a member in the first WALK_FIRST_BUCKETS; the
        others, and those the walk left, are scanned (`_scanned`, O(workers) in numpy)."""
        found: list[list[Group]] = [[] for _ in masks]
        # position in masks -> (the eligible members, buckets the walk may take to meet the first)
        walk: dict[int, tuple[int, int]] = {}
        num_eligible = self.mask.bit_count()
        for i, mask in enumerate(masks):
            mask &= self.mask
            if not mask:
                continue
            num_members = mask.bit_count()
            if num_members <= LIST_MEMBERS:
                found[i] = self._listed(mask, slack)
            elif num_members * WALK_SHARE >= num_eligible:
                walk[i] = (mask, WALK_BUCKETS)
            elif self._meets_top(mask):
                walk[i] = (mask, WALK_FIRST_BUCKETS)
            else:
                found[i] = self._scanned(mask, slack)
        if walk:
            self._walk(walk, slack, found)
        return found

    def _meets_top(self, mask: int) -> bool:
        """Whether a member of `mask` is in one of the heap's first three entries (the cheapest
        bucket and the second cheapest are among them): a cheap guess that a walk finds the mask's
        first member at once, where a popular prefix's busy holders would make it walk in vain."""
        bucket_mask = self._bucket_mask
        return any(bucket_mask.get(key, 0) & mask for _, key in self._heap[:3])

    def _listed(self, mask: int, slack: float) -> list[Group]:
        by_slot, key_of = self._by_slot, self._key_of
        keys = {key_of[by_slot[slot]] for slot in bit_positions(mask)}
        cost, bucket_mask = self._cost, self._bucket_mask
        top = min(cost[key] for key in keys) + slack
        near = sorted((cost[key], key) for key in keys if cost[key] <= top)
        return [Group(c, key, bucket_mask[key] & mask) for c, key in near]

    def _walk(self, walk: dict[int, tuple[int, int]], slack: float, found: list[list[Group]]) -> None:
        heap, popped = self._heap, []
        first_cost: dict[int, float] = {}
        bucket_mask = self._bucket_mask
        while heap and walk:
            if len(popped) >= WALK_FIRST_BUCKETS:
                # Out of buckets: a mask with its first group may go on to WALK_BUCKETS.
                for i in [i for i, (_, budget) in walk.items()
                          if len(popped) >= (WALK_BUCKETS if i in first_cost else budget)]:
                    found[i] = self._scanned(walk.pop(i)[0], slack)
                if not walk:
                    break
            cost, key = heap[0]
            members = bucket_mask.get(key)
            if members is None:  # emptied since it was pushed
                heapq.heappop(heap)
                self._queued.discard(key)
                continue
            popped.append(heapq.heappop(heap))
            for i in list(walk):
                first = first_cost.get(i)
                if first is not None and cost > first + slack:
                    del walk[i]
                    continue
                inside = members & walk[i][0]
                if inside:
                    found[i].append(Group(cost, key, inside))
                    if first is None:
                        first_cost[i] = cost
        for entry in popped:
            heapq.heappush(heap, entry)

    def _scanned(self, mask: int, slack: float) -> list[Group]:
        """cheapest_in of one mask by a vectorized pass over the members' load costs (O(workers) in
        numpy, O(buckets returned) in Python)."""
        raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
        inside = np.unpackbits(raw, bitorder="little").view(bool)
        costs = np.where(inside, self._slot_cost[:len(inside)], math.inf)
        near = costs <= costs.min() + slack
        near_mask = int.from_bytes(np.packbits(near, bitorder="little").tobytes(), "little")
        groups = []
        while near_mask:
            key = self._key_of[self._by_slot[(near_mask & -near_mask).bit_length() - 1]]
            members = self._bucket_mask[key]
            groups.append(Group(self._cost[key], key, members & mask))
            near_mask &= ~members
        groups.sort(key=lambda g: (g.cost, g.key))
        return groups

    def pick_in(self, group: Group, index: int) -> str:
        """The `index`-th member of `group` in its bucket's order (as `pick` with the bucket's
        other members excluded). O(min(members in the group, members outside it))."""
        members = self._buckets[group.key]
        outside = self._bucket_mask[group.key] ^ group.mask
        if group.mask.bit_count() <= outside.bit_count():
            by_slot, slot = self._by_slot, self._slot
            places = sorted(slot[by_slot[s]] for s in bit_positions(group.mask))
            return members[places[index]]
        return self.pick(Bucket(group.cost, group.key, members), index,
                         [self._by_slot[s] for s in bit_positions(outside)])

    def pick(self, bucket: Bucket, index: int, excluded: Collection[str] = ()) -> str:
        """The `index`-th member of `bucket` outside `excluded` (in the bucket's order)."""
        skipped = sorted(self._slot[w] for w in excluded if self._key_of.get(w) == bucket.key)
        for slot in skipped:
            if slot <= index:
                index += 1
            else:
                break
        return bucket.members[index]
