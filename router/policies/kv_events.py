"""kv_events (the default): lowest cost wins, where cost = new prefill tokens after the overlap the
workers' own KV events report + weighted load (kvmesh.router.cost), with hysteresis: the cheapest
worker holding the longest cached prefix keeps the request unless another one is cheaper by more than
`weights.stay_margin`. Ties are broken at random; with a temperature > 0 the first choice is sampled
from softmax(-cost / (temperature * prompt tokens)).
Cache affinity never picks an unhealthy worker or one at its cap: those are filtered before scoring.
"""

from collections.abc import Sequence

import numpy as np

from kvmesh.router.cost import CostWeights, worker_costs
from kvmesh.router.index import KVIndex
from kvmesh.router.policies.base import Policy, RouteRequest, rank_by_score
from kvmesh.router.workers import WorkerState, columns_of


class KVEventsPolicy(Policy):
    name = "kv_events"

    def __init__(self, index: KVIndex, block_size: int = 16, weights: CostWeights | None = None,
                 temperature: float = 0.0, seed: int | None = None):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.index = index
        self.block_size = block_size
        self.weights = weights or CostWeights()
        self.temperature = temperature
        self._rng = np.random.default_rng(seed)

    def cached_tokens(self, request: RouteRequest, cols) -> np.ndarray:
        cached = np.zeros(len(cols.ids), dtype=np.float64)
        # At least one prompt token is always computed (the block manager caps its hits the same way).
        limit = max(request.num_prompt_tokens - 1, 0)
        for wid, blocks in self.index.overlap(request.block_hashes).items():
            row = cols.row(wid)
            if row is not None:
                cached[row] = min(blocks * self.block_size, limit)
        return cached

    def rank(self, request: RouteRequest, workers: Sequence[WorkerState]) -> list[str]:
        cols = columns_of(workers)
        cached = self.cached_tokens(request, cols)
        cost = worker_costs(request.num_prompt_tokens, cached, cols, self.weights)
        if self.weights.stay_margin > 0:
            self._keep_prefix_holder(cost, cached, cols)
        if self.temperature > 0:
            cost = self._sampled_first(cost, cols, request.num_prompt_tokens)
        return rank_by_score(cost, cols, self._rng)

    def _keep_prefix_holder(self, cost: np.ndarray, cached: np.ndarray, cols) -> None:
        """Hysteresis, in place: move the cheapest eligible holder of the longest cached prefix just
        ahead of the cheapest worker when it costs at most `stay_margin` more."""
        holders = np.flatnonzero(cached)  # few rows: only workers the index reports
        if not len(holders):
            return
        eligible = cols.eligible
        holders = holders[eligible[holders]]
        if not len(holders):
            return
        held = cached[holders]
        holders = holders[held == held.max()]
        stay = holders[np.argmin(cost[holders])]
        best = cost.min() if eligible.all() else cost[eligible].min()
        if best < cost[stay] <= best + self.weights.stay_margin:
            cost[stay] = np.nextafter(best, -np.inf)  # first; the others keep their order

    def _sampled_first(self, cost: np.ndarray, cols, num_prompt_tokens: int) -> np.ndarray:
        eligible = np.flatnonzero(cols.eligible)
        if len(eligible) < 2:
            return cost
        c = cost[eligible]
        logits = -(c - c.min()) / (self.temperature * max(num_prompt_tokens, 1))
        p = np.exp(logits)
        pick = eligible[self._rng.choice(len(eligible), p=p / p.sum())]
        cost = cost.copy()
        cost[pick] = -np.inf  # first; the rest keep their cost order
        return cost
