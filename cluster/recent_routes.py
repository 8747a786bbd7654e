"""Prefixes this router copy sent somewhere in the last moments, before their KV events arrive.

A worker reports the blocks of a prompt after its prefill step; until that batch has travelled
worker -> hub -> router copy (milliseconds, but longer than a quick follow-up request takes to
arrive), the index does not know the prefix is there. Two requests with the same new prefix in a
burst would then both be placed by load alone and both compute it. This map bridges that gap:
block hash -> the worker its request was routed to, forgotten after `ttl_s` (by then the events
have told the index the truth, including evictions). Only the kv_events policy consults it.
"""

from __future__ import annotations

import time
from collections import OrderedDict


class RecentRoutes:
    def __init__(self, ttl_s: float = 2.0, max_entries: int = 200_000, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._routes: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def record(self, block_hashes: list[int], worker_id: str) -> None:
        now = self.clock()
        for h in block_hashes:
            self._routes[h] = (worker_id, now)
            self._routes.move_to_end(h)
        self._expire(now)

    def match(self, block_hashes: list[int]) -> tuple[str | None, int]:
        """(worker, leading blocks) of the longest recent prefix routed to one worker."""
        now = self.clock()
        self._expire(now)
        worker, num = None, 0
        for h in block_hashes:
            entry = self._routes.get(h)
            if entry is None or (worker is not None and entry[0] != worker):
                break
            worker, num = entry[0], num + 1
        return worker, num

    def forget_worker(self, worker_id: str) -> None:
        for h in [h for h, (w, _) in self._routes.items() if w == worker_id]:
            del self._routes[h]

    def _expire(self, now: float) -> None:
        routes = self._routes
        while routes:
            h, (_, t) = next(iter(routes.items()))
            if now - t <= self.ttl_s and len(routes) <= self.max_entries:
                break
            routes.popitem(last=False)
