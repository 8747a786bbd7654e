"""kv_events (the default): lowest cost wins, where cost = new prefill tokens after the overlap the
workers' own KV events report + weighted load (kvmesh.router.cost), with hysteresis: when that
prefix is at least `weights.stay_min_cached` of the prompt (a continuation), the cheapest worker
holding it keeps the request unless another one is cheaper by more than `weights.stay_margin`.
A worker computing a prefix this policy has just sent it (kvmesh.router.pending: in flight, not yet
in the index) is credited with a copy saved (`weights.in_flight` per token). Ties are broken at
random; with a temperature > 0 the first choice is sampled from softmax(-cost / (temperature *
prompt tokens)).
Cache affinity never picks an unhealthy worker or one at its cap: those are filtered before scoring.
"""

from collections.abc import Sequence

import numpy as np

from kvmesh.router.cost import CostWeights, worker_costs
from kvmesh.router.index import KVIndex
from kvmesh.router.pending import PendingPrefixes
from kvmesh.router.policies.base import Policy, RouteRequest, order_by_score, rank_by_score, spill_over
from kvmesh.router.workers import WorkerState, columns_of


class KVEventsPolicy(Policy):
    name = "kv_events"

    def __init__(self, index: KVIndex, block_size: int = 16, weights: CostWeights | None = None,
                 temperature: float = 0.0, seed: int | None = None, pending_requests: int = 4096):
        """`pending_requests`: how many routed requests to remember as in flight (0: none, the index
        alone)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if pending_requests < 0:
            raise ValueError(f"pending_requests must be >= 0, got {pending_requests}")
        self.index = index
        self.block_size = block_size
        self.weights = weights or CostWeights()
        self.temperature = temperature
        self.pending = PendingPrefixes(pending_requests) if pending_requests else None
        self._rng = np.random.default_rng(seed)

    def remove_worker(self, worker_id: str) -> None:
        if self.pending is not None:
            self.pending.forget_worker(worker_id)

    def cached_tokens(self, request: RouteRequest, cols) -> np.ndarray:
        return self._holdings(request, cols)[0]

    def _holdings(self, request: RouteRequest, cols) -> tuple[np.ndarray, dict[int, float], dict[str, int]]:
        """([n] cached prompt tokens per row, {row: cached tokens} for the rows holding any,
        {worker: leading blocks the index shows})."""
        cached = np.zeros(len(cols.ids), dtype=np.float64)
        held: dict[int, float] = {}
        # At least one prompt token is always computed (the block manager caps its hits the same way).
        limit = max(request.num_prompt_tokens - 1, 0)
        overlaps = self.index.overlap(request.block_hashes)
        for wid, blocks in overlaps.items():
            row = cols.row(wid)
            if row is not None:
                held[row] = cached[row] = min(blocks * self.block_size, limit)
        return cached, held, overlaps

    def _in_flight(self, request: RouteRequest, cols, overlaps: dict[str, int]) -> tuple[int, float] | None:
        """(row, prompt tokens) the worker of that row is computing for an earlier request, past
        what the index shows it holds; None when no record continues the longest indexed prefix."""
        if self.pending is None:
            return None
        longest = max(overlaps.values(), default=0)
        wid, extra = self.pending.continuation(request.block_hashes, longest)
        if wid is None or overlaps.get(wid, 0) != longest:
            return None
        row = cols.row(wid)
        if row is None:
            return None
        limit = max(request.num_prompt_tokens - 1, 0)
        tokens = min((longest + extra) * self.block_size, limit) - min(longest * self.block_size, limit)
        return (row, tokens) if tokens > 0 else None

    def rank(self, request: RouteRequest, workers: Sequence[WorkerState]) -> list[str]:
        ranked, overlaps = self._rank(request, workers)
        if ranked and self.pending is not None:  # the first is the one used (Policy's contract)
            self.pending.record(request.block_hashes, overlaps.get(ranked[0], 0), ranked[0])
        return ranked

    def _rank(self, request: RouteRequest,
              workers: Sequence[WorkerState]) -> tuple[list[str], dict[str, int]]:
        num_prompt_tokens = request.num_prompt_tokens
        cols = columns_of(workers)
        cached, held, overlaps = self._holdings(request, cols)
        cost = worker_costs(num_prompt_tokens, cached, cols, self.weights)
        in_flight = self._in_flight(request, cols, overlaps)
        if in_flight is not None:
            cost[in_flight[0]] -= self.weights.in_flight * in_flight[1]
        use_margin = bool(held) and self.weights.stay_margin > 0
        if self.temperature > 0:
            eligible = cols.eligible
            if use_margin and eligible.any():
                best = int(np.flatnonzero(eligible)[np.argmin(cost[eligible])])
                stay = self._holder_that_stays(cost, held, eligible, best, num_prompt_tokens)
                if stay is not None:
                    cost[stay] = np.nextafter(cost[best], -np.inf)
            ranked = rank_by_score(self._sampled_first(cost, cols, num_prompt_tokens), cols, self._rng)
            return ranked, overlaps
        # The hysteresis is applied to the sorted order (not as another pass over every worker).
        order, eligible = order_by_score(cost, cols, self._rng)
        if use_margin and len(order) > 1:
            stay = self._holder_that_stays(cost, held, eligible, int(order[0]), num_prompt_tokens)
            if stay is not None:
                order = np.concatenate(([stay], order[order != stay]))  # the others keep their order
        return cols.ids_at(order) + spill_over(cols, eligible), overlaps

    def _holder_that_stays(self, cost: np.ndarray, held: dict[int, float], eligible: np.ndarray,
                           best: int, num_prompt_tokens: int) -> int | None:
        """Hysteresis: the cheapest eligible holder of the longest cached prefix, when that prefix is
        at least `stay_min_cached` of the prompt, the cheapest eligible worker `best` holds less of
        it, and the holder costs at most `stay_margin` more; else None."""
        holders = [(tokens, row) for row, tokens in held.items() if eligible[row]]
        if not holders:
            return None
        longest = max(tokens for tokens, _ in holders)
        if held.get(best, 0.0) >= longest or longest < self.weights.stay_min_cached * num_prompt_tokens:
            return None
        stay = min((row for tokens, row in holders if tokens == longest), key=cost.__getitem__)
        return stay if cost[stay] - cost[best] <= self.weights.stay_margin else None

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
