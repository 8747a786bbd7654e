"""kv_events (the default): lowest cost wins, where cost = new prefill tokens after the overlap the
workers' own KV events report + weighted load (kvmesh.router.cost), with hysteresis: when that
prefix is at least `weights.stay_min_cached` of the prompt (a continuation), the cheapest worker
holding it keeps the request unless another one is cheaper by more than `weights.stay_margin`.
A worker computing a prefix this policy has just sent it (kvmesh.router.pending: in flight, not yet
in the index) is credited with a copy saved (`weights.in_flight` per token). Ties are broken at
random; with a temperature > 0 the first choice is sampled from softmax(-cost / (temperature *
prompt tokens)).
Cache affinity never picks an unhealthy worker or one at its cap: those are filtered before scoring.

The choice costs O(prompt runs + holders of its prefix), not O(workers): only the eligible holders
(and the worker with the prefix in flight) are scored exactly; a worker holding none of the prefix
costs the new prefill plus its load alone, so the best of those is the first bucket of a LoadOrder
the WorkerSet keeps up to date (kvmesh.router.load_order), whose cost is computed exactly too. Ties
for the best are broken uniformly over every tied worker, as a full ranking's would be. The rest of a
full ranking (Serve's fallbacks: `rank`, not `top(k=1)`), a softmax temperature, or a plain list of
workers instead of a WorkerSet, take the vectorized pass over all workers.
"""

from collections.abc import Sequence

import numpy as np

from kvmesh.router.cost import CostWeights, load_cost, worker_costs
from kvmesh.router.index import KVIndex
from kvmesh.router.load_order import LoadOrder
from kvmesh.router.pending import PendingPrefixes
from kvmesh.router.policies.base import Policy, RouteRequest, order_by_score, rank_by_score, spill_over
from kvmesh.router.workers import LoadColumns, WorkerSet, WorkerState, columns_of

# Load-order buckets this close in cost (tokens) are all costed exactly: the order's sum and the cost's
# differ by float rounding, so a bucket a rounding below another may tie with it in the exact cost.
TIE_SLACK = 1e-6
# When more than this fraction of the eligible workers hold part of the prompt (a system prompt every
# worker caches), scoring holders one by one in Python costs more than the vectorized pass over all.
FULL_PASS_HOLDERS = 0.125


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
        self._order: LoadOrder | None = None
        self._watched: WorkerSet | None = None  # the WorkerSet that keeps _order up to date

    def remove_worker(self, worker_id: str) -> None:
        if self.pending is not None:
            self.pending.forget_worker(worker_id)

    def cached_tokens(self, request: RouteRequest, cols) -> np.ndarray:
        cached = np.zeros(len(cols.ids), dtype=np.float64)
        for row, tokens in self._holdings(request, cols)[0].items():
            cached[row] = tokens
        return cached

    def _holdings(self, request: RouteRequest, cols) -> tuple[dict[int, float], dict[str, int]]:
        """({row: cached prompt tokens} for the rows holding any, {worker: leading blocks the index
        shows})."""
        held: dict[int, float] = {}
        # At least one prompt token is always computed (the block manager caps its hits the same way).
        limit = max(request.num_prompt_tokens - 1, 0)
        overlaps = self.index.overlap(request.block_hashes)
        for wid, blocks in overlaps.items():
            row = cols.row(wid)
            if row is not None:
                held[row] = min(blocks * self.block_size, limit)
        return held, overlaps

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
        return self.top(request, workers, None)

    def top(self, request: RouteRequest, workers: Sequence[WorkerState], k: int | None) -> list[str]:
        if self.temperature > 0 or not isinstance(workers, WorkerSet):
            ranked, overlaps = self._rank(request, workers)
        else:
            ranked, overlaps = self._rank_from_choice(request, workers, k)
        if ranked and self.pending is not None:  # the first is the one used (Policy's contract)
            self.pending.record(request.block_hashes, overlaps.get(ranked[0], 0), ranked[0])
        return ranked if k is None else ranked[:k]

    def _rank_from_choice(self, request: RouteRequest, workers: WorkerSet,
                          k: int | None) -> tuple[list[str], dict[str, int]]:
        """The choice without a pass over all workers; then, unless only it is asked for, the others
        by ascending cost and the spill-over."""
        if self._watched is not workers:
            self._order = LoadOrder(lambda key: load_cost(key, self.weights))
            workers.watch(self._order)
            self._watched = workers
        cols = workers.columns()
        held, overlaps = self._holdings(request, cols)
        if len(held) > FULL_PASS_HOLDERS * len(self._order):
            return self._rank(request, workers, (held, overlaps))
        first = self._choose(request, cols, held, overlaps)
        if first is None:
            return spill_over(cols), overlaps
        if k == 1:
            return [cols.ids[first]], overlaps
        cost = self._costs(request, cols, held, overlaps)
        order = np.flatnonzero(cols.eligible)
        order = order[np.argsort(cost[order])]
        order = np.concatenate(([first], order[order != first]))
        return cols.ids_at(order) + spill_over(cols, cols.eligible), overlaps

    def _choose(self, request: RouteRequest, cols: LoadColumns, held: dict[int, float],
                overlaps: dict[str, int]) -> int | None:
        """The row chosen (None when no worker is eligible), as the first of a full
        ranking: the cheapest eligible worker (a tie broken uniformly at random), or the holder that
        stays. Scores the eligible holders, the worker with the prefix in flight, and one member of
        each cheapest bucket of the load order (holders of none of the prefix)."""
        num_prompt_tokens = request.num_prompt_tokens
        in_flight = self._in_flight(request, cols, overlaps)
        eligible = cols.eligible
        scored = {row: tokens for row, tokens in held.items() if eligible[row]}
        if in_flight is not None and eligible[in_flight[0]]:
            scored.setdefault(in_flight[0], 0.0)
        excluded = [cols.ids[row] for row in scored]
        buckets = self._order.cheapest(excluded, TIE_SLACK)
        rows = list(scored) + [cols.row(bucket.members[0]) for bucket, _ in buckets]
        if not rows:
            return None
        cached = np.zeros(len(rows), dtype=np.float64)  # 0 for the buckets' members
        cached[:len(scored)] = list(scored.values())
        cost = worker_costs(num_prompt_tokens, cached, cols, self.weights,
                            np.array(rows, dtype=np.intp)).tolist()
        if in_flight is not None and in_flight[0] in scored:
            cost[list(scored).index(in_flight[0])] -= self.weights.in_flight * in_flight[1]
        best_cost = min(cost)
        tied = [row for row, c in zip(rows, cost[:len(scored)]) if c == best_cost]
        tied_buckets = [(bucket, n) for (bucket, n), c in zip(buckets, cost[len(scored):]) if c == best_cost]
        num_tied = len(tied) + sum(n for _, n in tied_buckets)
        pick = int(self._rng.integers(num_tied)) if num_tied > 1 else 0
        best = tied[pick] if pick < len(tied) else self._bucket_member(tied_buckets, pick - len(tied),
                                                                      excluded, cols)
        if held and self.weights.stay_margin > 0:
            costs = dict(zip(rows, cost))
            costs.setdefault(best, best_cost)
            stay = self._holder_that_stays(costs, held, eligible, best, num_prompt_tokens)
            if stay is not None:
                best = stay
        return best

    def _bucket_member(self, buckets: list, index: int, excluded: list[str], cols) -> int:
        """The row of the `index`-th worker (outside `excluded`) of `buckets`, [(bucket, count)]."""
        for bucket, count in buckets:
            if index < count:
                return cols.row(self._order.pick(bucket, index, excluded))
            index -= count
        raise IndexError(f"{index} past the tied buckets' members")

    def _costs(self, request: RouteRequest, cols, held: dict[int, float],
               overlaps: dict[str, int]) -> np.ndarray:
        """[n] every worker's cost (the in-flight credit included)."""
        cached = np.zeros(len(cols.ids), dtype=np.float64)
        for row, tokens in held.items():
            cached[row] = tokens
        cost = worker_costs(request.num_prompt_tokens, cached, cols, self.weights)
        in_flight = self._in_flight(request, cols, overlaps)
        if in_flight is not None:
            cost[in_flight[0]] -= self.weights.in_flight * in_flight[1]
        return cost

    def _rank(self, request: RouteRequest, workers: Sequence[WorkerState],
              holdings: tuple[dict[int, float], dict[str, int]] | None = None,
              ) -> tuple[list[str], dict[str, int]]:
        """The full ranking, every worker costed; `holdings`: _holdings' answer, when known."""
        num_prompt_tokens = request.num_prompt_tokens
        cols = columns_of(workers)
        held, overlaps = holdings or self._holdings(request, cols)
        cost = self._costs(request, cols, held, overlaps)
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

    def _holder_that_stays(self, cost, held: dict[int, float], eligible: np.ndarray,
                           best: int, num_prompt_tokens: int) -> int | None:
        """Hysteresis: the cheapest eligible holder of the longest cached prefix, when that prefix is
        at least `stay_min_cached` of the prompt, the cheapest eligible worker `best` holds less of
        it, and the holder costs at most `stay_margin` more; else None. `cost`: by row (an array, or a
        mapping with the eligible holders and `best`)."""
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
