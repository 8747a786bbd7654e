"""The eligible workers in order of a load cost, kept up to date as loads change, so that a policy finds
the least loaded workers without a pass over all of them.

A policy's cost of a worker is a part that depends on the request (its cached prefix) plus a part
that depends only on the worker's load. Workers that hold none of a request's prefix differ only in
the second, so the cheapest of them is the first in load order: the kv_events policy scores the
holders of the prompt's blocks exactly and takes the best of the others from here.

Workers with the same load components (`LoadKey`) share a bucket, whose cost is computed once; the
buckets are kept sorted by cost in chunks of consecutive buckets (as sortedcontainers' SortedList
keeps its values: an update inserts or removes a bucket by bisection within one chunk). Idle workers
all share one bucket, so a cold cluster's thousand tied workers cost one entry, and a uniform pick
among them is O(excluded) (`pick`).

Given `slot_of` (the KV index's slot of a worker, `KVIndex.slot`), each bucket also keeps its members
as a bitmask of those slots, `mask` is every eligible worker's, and each slot's load cost and bucket
are kept in arrays indexed by slot: the policy then asks for the cheapest members of a set of
workers given as a mask (the index's holder levels), `cheapest_in`, without listing the set: each
chunk keeps the union of its buckets' masks, so the first chunk whose union meets the set holds its
cheapest member (one AND per chunk passed, whatever the set's size). A decision runs with caches
that the work between decisions has evicted, so what it costs is mostly the distinct objects it
touches: the chunks' masks, the first buckets, or the slot arrays (docs/ROUTING.md "Inside the
simulator").
"""

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Iterator
from operator import itemgetter
from typing import NamedTuple

from kvmesh.router.index import bit_positions

# How the cheapest members of a mask are found (cheapest_in): a mask of at most LIST_MEMBERS workers by
# listing them (their load costs read from the slot array); a larger one by the chunks, from the
# cheapest: the first chunk meeting it holds its cheapest member, found among the chunk's members of
# the mask the same way (listed when at most LIST_MEMBERS, else the chunk's buckets in order). A
# popular prefix's busy holders (17-511 of 4,096 workers) have their cheapest a median 266 buckets
# down the order (p90 1,089, p99 3,083 of ~3,900; 4,096 tenants, seed 100): some 2-24 chunks of
# ~128 buckets passed, instead of 17-511 members' costs read (docs/ROUTING.md "Inside the simulator").
LIST_MEMBERS = 16
# A chunk's target length L is CHUNK_SQRT times the square root of the number of buckets, at least
# CHUNK_BUCKETS: a chunk longer than 2 L is split in two, one shorter than L / 2 joins its neighbour
# (any length when it is the only one). A longer chunk means fewer chunks passed, more of the mask's
# members in the one found: inside the simulator 64 was faster than 128 at 1,024 workers (~1,000
# buckets) and 128 than 64 or 256 at 4,096 (~3,900 buckets; 512 doubled the p99).
CHUNK_BUCKETS = 64
CHUNK_SQRT = 2


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


class _Bucket:
    """The eligible workers of one load key: `members` in the order `pick` counts them, `mask` their
    slot bits (with slot_of), `chunk` the chunk it sits in."""
    __slots__ = ("cost", "key", "members", "mask", "chunk")

    def __init__(self, cost: float, key: LoadKey):
        self.cost = cost
        self.key = key
        self.members: list[str] = []
        self.mask = 0
        self.chunk: _Chunk | None = None


class _Chunk:
    """Consecutive buckets of the sorted order, their costs (for bisection), and `mask` the union of
    their masks. A worker is in one bucket, so the buckets' masks are disjoint and a member joining or
    leaving one of them sets or clears its bit in the chunk's mask too."""
    __slots__ = ("buckets", "costs", "mask")

    def __init__(self, buckets: list[_Bucket]):
        self.buckets = buckets
        self.costs = array("d", [bucket.cost for bucket in buckets])
        mask = 0
        for bucket in buckets:
            bucket.chunk = self
            mask |= bucket.mask
        self.mask = mask


def _last_cost(chunk: _Chunk) -> float:
    return chunk.costs[-1]


class LoadOrder:
    def __init__(self, load_cost: Callable[[LoadKey], float],
                 slot_of: Callable[[str], int] | None = None):
        """`slot_of`: the bit of a worker in the masks (kept only when given)."""
        self.load_cost = load_cost
        self.slot_of = slot_of
        self.mask = 0  # bits of every eligible worker (with slot_of)
        self._key_of: dict[str, LoadKey] = {}
        self._by_key: dict[LoadKey, _Bucket] = {}  # non-empty buckets
        self._place: dict[str, int] = {}  # worker -> its index in its bucket's members
        self._chunks: list[_Chunk] = []  # every non-empty bucket by ascending cost, in chunks
        # with slot_of:
        self._bit: dict[str, int] = {}  # worker -> its bit, as slot_of said when it joined
        self._by_slot: list[str | None] = []  # slot -> eligible worker
        self._slot_bucket: list[_Bucket | None] = []  # slot -> its eligible worker's bucket
        self._slot_cost = array("d")  # slot -> its eligible worker's load cost, else inf

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
        bit = 0
        if self.slot_of is not None:
            bit = self._bit.get(worker_id, 0)
            if not bit:  # joins: its slot
                slot = self.slot_of(worker_id)
                bit = self._bit[worker_id] = 1 << slot
                if slot >= len(self._by_slot):
                    grow = slot + 1 - len(self._by_slot)
                    self._by_slot.extend([None] * grow)
                    self._slot_bucket.extend([None] * grow)
                    self._slot_cost.extend([math.inf] * grow)
                self._by_slot[slot] = worker_id
                self.mask |= bit
        if old is not None:
            self._leave(worker_id, old, bit)
        if key is not None:
            self._join(worker_id, key, bit)
        elif bit:
            slot = bit.bit_length() - 1
            del self._bit[worker_id]
            self._by_slot[slot] = self._slot_bucket[slot] = None
            self._slot_cost[slot] = math.inf
            self.mask ^= bit

    def discard(self, worker_id: str) -> None:
        self.update(worker_id, None)

    def _join(self, worker_id: str, key: LoadKey, bit: int) -> None:
        self._key_of[worker_id] = key
        bucket = self._by_key.get(key)
        if bucket is None:
            bucket = self._by_key[key] = _Bucket(self.load_cost(key), key)
            self._insert(bucket)
        self._place[worker_id] = len(bucket.members)
        bucket.members.append(worker_id)
        if bit:
            bucket.mask |= bit
            bucket.chunk.mask |= bit
            slot = bit.bit_length() - 1
            self._slot_bucket[slot] = bucket
            self._slot_cost[slot] = bucket.cost

    def _leave(self, worker_id: str, key: LoadKey, bit: int) -> None:
        del self._key_of[worker_id]
        bucket = self._by_key[key]
        members = bucket.members
        i = self._place.pop(worker_id)
        last = members.pop()
        if last != worker_id:  # the last member takes the freed place
            members[i] = last
            self._place[last] = i
        if bit:
            bucket.mask ^= bit
            bucket.chunk.mask ^= bit
        if not members:
            del self._by_key[key]
            self._remove(bucket)

    def _insert(self, bucket: _Bucket) -> None:
        """A new (empty) bucket into the sorted order, after those of an equal cost."""
        chunks = self._chunks
        if not chunks:
            chunks.append(_Chunk([bucket]))
            return
        cost = bucket.cost
        # the first chunk ending above `cost`, else the last
        i = min(bisect_right(chunks, cost, key=_last_cost), len(chunks) - 1)
        chunk = chunks[i]
        j = bisect_right(chunk.costs, cost)
        chunk.buckets.insert(j, bucket)
        chunk.costs.insert(j, cost)
        bucket.chunk = chunk
        if len(chunk.buckets) > 2 * self._chunk_length():
            self._split(i)

    def _remove(self, bucket: _Bucket) -> None:
        """An emptied bucket out of the sorted order."""
        chunk = bucket.chunk
        j = bisect_left(chunk.costs, bucket.cost)
        while chunk.buckets[j] is not bucket:  # among buckets of an equal cost
            j += 1
        del chunk.buckets[j]
        del chunk.costs[j]
        length = self._chunk_length()
        if len(chunk.buckets) >= length // 2 and chunk.buckets:
            return
        chunks = self._chunks
        i = chunks.index(chunk)  # identity: chunks define no equality
        if not chunk.buckets:
            del chunks[i]
        elif len(chunks) > 1:  # a short chunk joins its neighbour, split again if that is too long
            if i == len(chunks) - 1:
                i -= 1
            low, high = chunks[i], chunks[i + 1]
            for moved in high.buckets:
                moved.chunk = low
            low.buckets += high.buckets
            low.costs += high.costs
            low.mask |= high.mask
            del chunks[i + 1]
            if len(low.buckets) > 2 * length:
                self._split(i)

    def _chunk_length(self) -> int:
        return max(CHUNK_BUCKETS, CHUNK_SQRT * math.isqrt(len(self._by_key)))

    def _split(self, i: int) -> None:
        chunk = self._chunks[i]
        half = len(chunk.buckets) // 2
        upper = _Chunk(chunk.buckets[half:])
        del chunk.buckets[half:]
        del chunk.costs[half:]
        chunk.mask ^= upper.mask
        self._chunks.insert(i + 1, upper)

    def _in_order(self) -> Iterator[_Bucket]:
        """Every non-empty bucket by ascending cost."""
        for chunk in self._chunks:
            yield from chunk.buckets

    def cheapest(self, excluded: Collection[str] = (), slack: float = 0.0) -> list[tuple[Bucket, int]]:
        """The buckets in (cost, key) order from the first that has a member outside `excluded`,
        through every bucket within `slack` of its cost, each with its number of members outside
        `excluded` (buckets of excluded workers only are skipped); [] when every eligible worker is
        excluded. O(buckets skipped + returned + excluded)."""
        num_excluded: dict[LoadKey, int] = {}
        for w in excluded:
            key = self._key_of.get(w)
            if key is not None:
                num_excluded[key] = num_excluded.get(key, 0) + 1
        found, first_cost = [], None
        for bucket in self._in_order():
            if first_cost is not None and bucket.cost > first_cost + slack:
                break
            outside = len(bucket.members) - num_excluded.get(bucket.key, 0)
            if outside:
                found.append((Bucket(bucket.cost, bucket.key, bucket.members), outside))
                if first_cost is None:
                    first_cost = bucket.cost
        found.sort(key=lambda entry: (entry[0].cost, entry[0].key))
        return found

    def cheapest_in(self, masks: list[int], slack: float = 0.0) -> list[list[Group]]:
        """For each of `masks` (sets of workers as slot bits; needs slot_of), the buckets holding an
        eligible member of it, in (cost, key) order, from the cheapest through every one within
        `slack` of its cost, as groups (the bucket's members in the set); [] when no eligible worker
        is in the set. A set of up to LIST_MEMBERS eligible workers is listed (O(members)); a larger
        one found by the chunks (O(chunks passed + the members in the first chunk meeting it))."""
        found: list[list[Group]] = []
        eligible = self.mask
        for mask in masks:
            mask &= eligible
            if not mask:
                found.append([])
            elif mask.bit_count() <= LIST_MEMBERS:
                found.append(self._listed(mask, slack))
            else:
                found.append(self._chunked(mask, slack))
        return found

    def _chunked(self, mask: int, slack: float) -> list[Group]:
        """cheapest_in of one (non-empty, eligible) mask by the chunks: in the first chunk meeting it,
        and in the next ones while they start within `slack` of its cheapest."""
        groups: list[Group] = []
        top = math.inf  # the first group's cost + slack, once found
        for chunk in self._chunks:
            costs = chunk.costs
            if costs[0] > top:
                break
            inside = chunk.mask & mask
            if not inside:
                continue
            if inside.bit_count() <= LIST_MEMBERS:
                groups += [g for g in self._listed(inside, slack) if g.cost <= top]
                if top == math.inf:
                    top = groups[0].cost + slack
            else:  # many members here: the first buckets hold one
                for bucket, cost in zip(chunk.buckets, costs):
                    if cost > top:
                        break
                    held = bucket.mask & inside
                    if held:
                        groups.append(Group(cost, bucket.key, held))
                        if top == math.inf:
                            top = cost + slack
            if costs[-1] > top:
                break
        if len(groups) > 1:
            groups.sort()  # (cost, key): a bucket's key is unique, its mask never compared
        return groups

    def _listed(self, mask: int, slack: float) -> list[Group]:
        """cheapest_in of one mask by its members' load costs (the slot array), O(members)."""
        slots = bit_positions(mask)
        slot_bucket = self._slot_bucket
        if len(slots) == 1:
            bucket = slot_bucket[slots[0]]
            return [Group(bucket.cost, bucket.key, bucket.mask & mask)]
        # C-level passes (itemgetter, min, index, slices): ~half the time of a map over the members
        costs = itemgetter(*slots)(self._slot_cost)
        best = min(costs)
        top = best + slack
        i = costs.index(best)
        if min(costs[:i] + costs[i + 1:]) > top:  # the common case: one member at the least cost
            bucket = slot_bucket[slots[i]]
            return [Group(bucket.cost, bucket.key, bucket.mask & mask)]
        buckets = {slot_bucket[s] for s, c in zip(slots, costs) if c <= top}
        groups = [Group(b.cost, b.key, b.mask & mask) for b in buckets]
        if len(groups) > 1:
            groups.sort()
        return groups

    def pick_in(self, group: Group, index: int) -> str:
        """The `index`-th member of `group` in its bucket's order (as `pick` with the bucket's
        other members excluded). O(min(members in the group, members outside it))."""
        bucket = self._by_key[group.key]
        outside = bucket.mask ^ group.mask
        if group.mask.bit_count() <= outside.bit_count():
            by_slot, place = self._by_slot, self._place
            places = sorted(place[by_slot[s]] for s in bit_positions(group.mask))
            return bucket.members[places[index]]
        return self.pick(Bucket(bucket.cost, bucket.key, bucket.members), index,
                         [self._by_slot[s] for s in bit_positions(outside)])

    def pick(self, bucket: Bucket, index: int, excluded: Collection[str] = ()) -> str:
        """The `index`-th member of `bucket` outside `excluded` (in the bucket's order)."""
        skipped = sorted(self._place[w] for w in excluded if self._key_of.get(w) == bucket.key)
        for place in skipped:
            if place <= index:
                index += 1
            else:
                break
        return bucket.members[index]

    def members_of(self, key: LoadKey) -> list[str]:
        """The members of the bucket of `key`, in `pick`'s order ([] when none)."""
        bucket = self._by_key.get(key)
        return [] if bucket is None else bucket.members
