"""prefix_approx: a router-side prefix tree built from the router's own routing history (no events),
after SGLang's cache-aware router.

Each routed request's block hashes are recorded for the worker it went to; because the hashes are
chained, a hash stands for its whole prefix, so the map hash -> workers is a radix tree over tokens at
block granularity. Each worker's history is bounded (`max_blocks_per_worker`, least recently routed
dropped first): a guess of what its cache still holds, which is all this policy can know.

Decision: if the load is imbalanced (max - min outstanding > balance_abs and max > balance_rel * min)
the least loaded worker wins; else if the best match covers at least `cache_threshold` of the prompt,
the best-matching worker wins (ties: less loaded); else the least loaded.
"""

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvmesh.protocol import BlockRemoved, BlockStored, KVEventBatch
from kvmesh.router.index import KVIndex
from kvmesh.router.policies.base import Policy, RouteRequest, rank_by_score
from kvmesh.router.workers import WorkerState, columns_of


class PrefixApproxPolicy(Policy):
    name = "prefix_approx"

    def __init__(self, max_blocks_per_worker: int = 100_000, cache_threshold: float = 0.5,
                 balance_abs: int = 32, balance_rel: float = 1.5, seed: int | None = None):
        if max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker must be >= 1, got {max_blocks_per_worker}")
        self.max_blocks_per_worker = max_blocks_per_worker
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._rng = np.random.default_rng(seed)
        # The tree reuses the index structure, fed by this policy's own decisions.
        self.tree = KVIndex(max_blocks=max_blocks_per_worker * 1024)
        self._history: dict[str, OrderedDict[int, None]] = {}
        self._seq: dict[str, int] = {}

    def remove_worker(self, worker_id: str) -> None:
        self.tree.remove_worker(worker_id)
        self._history.pop(worker_id, None)
        self._seq.pop(worker_id, None)

    def state_bytes(self) -> int:
        return self.tree.approx_bytes()

    def rank(self, request: RouteRequest, workers: Sequence[WorkerState]) -> list[str]:
        cols = columns_of(workers)
        eligible = cols.eligible
        load = cols.outstanding
        if eligible.any():
            lo, hi = load[eligible].min(), load[eligible].max()
            imbalanced = hi - lo > self.balance_abs and hi > self.balance_rel * lo
        else:
            imbalanced = False
        # Tiny fraction of the load so that, among equal matches, the less loaded wins.
        score = load / (1.0 + load.max())
        num_blocks = len(request.block_hashes)
        if not imbalanced and num_blocks:
            match = np.zeros(len(cols.ids))
            for wid, blocks in self.tree.overlap(request.block_hashes).items():
                row = cols.row(wid)
                if row is not None and eligible[row]:
                    match[row] = blocks
            if match.max() >= self.cache_threshold * num_blocks:
                score = score - match
        ranked = rank_by_score(score, cols, self._rng)
        if ranked:
            self._record(ranked[0], request.block_hashes)
        return ranked

    def _record(self, worker_id: str, hashes: list[int]) -> None:
        history = self._history.setdefault(worker_id, OrderedDict())
        for h in hashes:
            history[h] = None
            history.move_to_end(h)
        evicted = []
        while len(history) > self.max_blocks_per_worker:
            evicted.append(history.popitem(last=False)[0])
        seq = self._seq.get(worker_id, 0)
        self._seq[worker_id] = seq + 1
        events = [BlockStored(block_hashes=list(hashes), parent_hash=None, num_tokens=0)]
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted))
        self.tree.apply(KVEventBatch(worker_id=worker_id, epoch=0, seq=seq, events=events))
