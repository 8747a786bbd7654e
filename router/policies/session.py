"""session: consistent hashing of a session key onto a ring of virtual nodes.

A key keeps its worker while that worker stays; when a worker joins it takes ~1/N of the keys, all
from others, and when one leaves only its keys move (to their next worker on the ring). Without a
session key the first block hash is the key (requests that share a first block, e.g. a system prompt,
stay together); with neither, the least loaded worker wins. A key whose worker is full or unhealthy
goes to the next distinct worker clockwise.
"""

from bisect import bisect_left
from collections.abc import Sequence

import numpy as np
import xxhash

from kvmesh.router.policies.base import Policy, RouteRequest, ranked_order
from kvmesh.router.workers import WorkerState, columns_of

RING_CANDIDATES = 3  # distinct workers taken from the ring; the rest follow by load


class SessionPolicy(Policy):
    name = "session"

    def __init__(self, virtual_nodes: int = 64):
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        self._members: set[str] = set()
        self._points: list[int] = []  # sorted ring positions
        self._owners: list[str] = []  # owner of each position

    def add_worker(self, worker_id: str) -> None:
        if worker_id not in self._members:
            self._members.add(worker_id)
            self._rebuild()

    def remove_worker(self, worker_id: str) -> None:
        if worker_id in self._members:
            self._members.discard(worker_id)
            self._rebuild()

    def _rebuild(self) -> None:
        ring = sorted((_point(f"{wid}#{v}"), wid)
                      for wid in self._members for v in range(self.virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [w for _, w in ring]

    def owner(self, key: str) -> str | None:
        """The worker a key maps to when every member is eligible."""
        if not self._points:
            return None
        return self._owners[bisect_left(self._points, _point(key)) % len(self._points)]

    def rank(self, request: RouteRequest, workers: Sequence[WorkerState]) -> list[str]:
        cols = columns_of(workers)
        for wid in cols.ids:
            if wid not in self._members:
                self.add_worker(wid)
        eligible = cols.eligible
        key = request.session_key
        if key is None and request.block_hashes:
            key = f"block:{request.block_hashes[0]}"
        chosen: list[int] = []
        if key is not None and self._points:
            start = bisect_left(self._points, _point(key))
            n_points = len(self._points)
            seen: set[str] = set()
            for step in range(n_points):
                wid = self._owners[(start + step) % n_points]
                if wid in seen:
                    continue
                seen.add(wid)
                row = cols.row(wid)
                if row is not None and eligible[row]:
                    chosen.append(row)
                    if len(chosen) == RING_CANDIDATES:
                        break
                if len(seen) == len(self._members):
                    break
        rest = np.flatnonzero(eligible)
        if chosen:
            rest = rest[~np.isin(rest, chosen)]
        rest = rest[np.argsort(cols.outstanding[rest], kind="stable")]
        return ranked_order([*chosen, *rest], cols)


def _point(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode("utf-8"))
