"""kv_events (the default): lowest cost wins, where cost = new prefill tokens after the overlap the
workers' own KV events report + weighted load (kvmesh.router.cost), with hysteresis: when that
prefix is at least `weights.stay_min_cached` of the prompt (a continuation), the cheapest worker
holding it keeps the request unless another one is cheaper by more than `weights.stay_margin`.
A worker computing a prefix this policy has just sent it (kvmesh.router.pending: in flight, not yet
in the index) is credited with a copy saved (`weights.in_flight` per token); once that request has
ended there (Router.finish_routed) the blocks are held, and credited as cached (`weights.prefill`
per token) until the index shows them. New work behind a short
shared prefix (under `weights.stay_min_cached` of the prompt held or in flight anywhere) is charged
the delay of its missing tokens, not a second copy (weights_for). Ties are broken at
random; with a temperature > 0 the first choice is sampled from softmax(-cost / (temperature *
prompt tokens)).
Cache affinity never picks an unhealthy worker or one at its cap: those are filtered before scoring.

The choice costs O(prompt runs + holder levels), not O(workers) nor O(holders): the index answers
with one mask of workers per cached length (KVIndex.levels); the members of a level, like the
workers holding none of the prefix, differ only in load, so the cheapest of each are the first
buckets of a LoadOrder the WorkerSet keeps up to date (kvmesh.router.load_order) that hold one of
them, and only those groups (and the worker with the prefix in flight) are costed exactly. Ties for
the best are broken uniformly over every tied worker, as a full ranking's would be. The rest of a
full ranking (Serve's fallbacks: `rank`, not `top(k=1)`), a softmax temperature, or a plain list of
workers instead of a WorkerSet, take the vectorized pass over all workers.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvmesh.router.cost import CostWeights, load_cost, worker_cost, worker_costs
from kvmesh.router.index import KVIndex, bit_positions
from kvmesh.router.load_order import LoadOrder
from kvmesh.router.pending import PendingPrefixes
from kvmesh.router.policies.base import Policy, RouteRequest, order_by_score, rank_by_score, spill_over
from kvmesh.router.workers import LoadColumns, WorkerSet, WorkerState, columns_of

# Load-order buckets this close in cost (tokens) are all costed exactly: the order's sum and the cost's
# differ by float rounding, so a bucket a rounding below another may tie with it in the exact cost.
TIE_SLACK = 1e-6


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
        # New work behind a short shared prefix: its missing tokens weigh their delay alone (new_work)
        self._new_work = dataclasses.replace(self.weights, prefill=self.weights.queued_prefill, in_flight=0.0)
        self.temperature = temperature
        self.pending = PendingPrefixes(pending_requests) if pending_requests else None
        self._rng = np.random.default_rng(seed)
        self._order: LoadOrder | None = None
        self._watched: WorkerSet | None = None  # the WorkerSet that keeps _order up to date

    def remove_worker(self, worker_id: str) -> None:
        if self.pending is not None:
            self.pending.forget_worker(worker_id)

    def on_finished(self, block_hashes: Sequence[int], worker_id: str) -> None:
        if self.pending is not None:
            self.pending.mark_computed(block_hashes, worker_id)

    def state_bytes(self) -> int:
        return self.index.approx_bytes()

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

    def _in_flight(self, request: RouteRequest, cols, overlaps: dict[str, int]) -> tuple[int, float, bool] | None:
        """(row, prompt tokens, computed) the worker of that row is computing for an earlier request
        (or has computed: that request ended there), past what the index shows it holds; None when
        no record continues the longest indexed prefix."""
        if self.pending is None:
            return None
        longest = max(overlaps.values(), default=0)
        wid, extra, computed = self.pending.continuation(request.block_hashes, longest)
        if wid is None or overlaps.get(wid, 0) != longest:
            return None
        row = cols.row(wid)
        if row is None:
            return None
        limit = max(request.num_prompt_tokens - 1, 0)
        tokens = min((longest + extra) * self.block_size, limit) - min(longest * self.block_size, limit)
        return (row, tokens, computed) if tokens > 0 else None

    def rank(self, request: RouteRequest, workers: Sequence[WorkerState]) -> list[str]:
        return self.top(request, workers, None)

    def top(self, request: RouteRequest, workers: Sequence[WorkerState], k: int | None) -> list[str]:
        if self.temperature > 0 or not isinstance(workers, WorkerSet):
            ranked, overlaps = self._rank(request, workers)
        else:
            ranked, overlaps = self._rank_from_choice(request, workers, k)
        if ranked and self.pending is not None:  # the first is the one used (Policy's contract)
            first_blocks = overlaps if isinstance(overlaps, int) else overlaps.get(ranked[0], 0)
            self.pending.record(request.block_hashes, first_blocks, ranked[0])
        return ranked if k is None else ranked[:k]

    def _rank_from_choice(self, request: RouteRequest, workers: WorkerSet,
                          k: int | None) -> tuple[list[str], dict[str, int] | int]:
        """The choice without a pass over all workers, with its cached blocks (k == 1); else the
        others too, by ascending cost, and the spill-over, with every worker's cached blocks."""
        first, first_blocks = self._choose(request, workers)
        cols = workers.columns()
        if k == 1:
            if first is None:
                ranked = spill_over(cols)[:1]
                return ranked, (self._blocks_on(request, ranked[0]) if ranked else 0)
            return [first], first_blocks
        held, overlaps = self._holdings(request, cols)
        if first is None:
            return spill_over(cols), overlaps
        first_row = cols.row(first)
        cost = self._costs(request, cols, held, overlaps)
        order = np.flatnonzero(cols.eligible)
        order = order[np.argsort(cost[order])]
        order = np.concatenate(([first_row], order[order != first_row]))
        return cols.ids_at(order) + spill_over(cols, cols.eligible), overlaps

    def _blocks_on(self, request: RouteRequest, worker_id: str) -> int:
        return self.index.overlap(request.block_hashes, [worker_id]).get(worker_id, 0)

    def _choose(self, request: RouteRequest, workers: WorkerSet) -> tuple[str | None, int]:
        """(the worker chosen, the prompt's blocks the index shows on it); None when no worker is
        eligible. The first of a full ranking: the cheapest eligible worker (a tie broken uniformly
        at random over every tied worker, in the order holders by (blocks, slot), the worker with the
        prefix in flight, then the load order's), or the holder that stays (hysteresis).

        The index answers with holder levels (a mask of workers per cached length, KVIndex.levels);
        the members of a level differ only in load, so its cheapest are the first of the load
        order's buckets holding one (LoadOrder.cheapest_in), as are those of the workers holding none
        of the prefix: a handful of groups are costed, whatever the number of holders."""
        order = self._watch(workers)
        block_size = self.block_size
        num_prompt_tokens = request.num_prompt_tokens
        limit = max(num_prompt_tokens - 1, 0)  # at least one prompt token is always computed
        levels = self.index.levels(request.block_hashes)
        num_levels = len(levels)
        in_flight = self._in_flight_of(request, levels, order, limit)  # (bit, key, tokens, computed)
        longest = min(levels[-1][0] * block_size, limit) if levels else 0
        in_flight_bit = 0
        if in_flight is not None:
            in_flight_bit, in_flight_key, in_flight_tokens, in_flight_computed = in_flight
            weights = self.weights_for(num_prompt_tokens, longest + in_flight_tokens)
        else:
            weights = self.weights_for(num_prompt_tokens, longest)
        eligible = order.mask ^ in_flight_bit  # the in-flight worker (eligible) is costed alone
        holders = 0
        masks = []
        for _, mask in levels:
            holders |= mask
            masks.append(mask & eligible)
        masks.append(eligible ^ (eligible & holders))  # the workers holding none of the prefix
        found = order.cheapest_in(masks, TIE_SLACK)
        # One flat list of the costed groups, (cost, level, member bits, load-order group): level i for
        # the holders of levels[i] (the in-flight worker with the last level, or alone at num_levels
        # when nobody holds the prefix), None for the workers holding none, whose group is kept for
        # pick_in. Built in the order a tie is broken in.
        tokens = [min(num_blocks * block_size, limit) for num_blocks, _ in levels]
        costed = []
        for level in range(num_levels):
            cached = tokens[level]
            for group in found[level]:
                cost = worker_cost(num_prompt_tokens, cached, group.key, weights)
                costed.append((cost, level, group.mask, None))
        if in_flight is not None:
            cost = worker_cost(num_prompt_tokens, tokens[-1] if levels else 0, in_flight_key, weights)
            cost -= in_flight_credit(weights, in_flight_computed) * in_flight_tokens
            costed.append((cost, max(num_levels - 1, 0), in_flight_bit, None))
        for group in found[-1]:
            costed.append((worker_cost(num_prompt_tokens, 0, group.key, weights), None, group.mask, group))
        if not costed:
            return None, 0
        best_cost = min([entry[0] for entry in costed])
        tied = [entry for entry in costed if entry[0] == best_cost]
        if len(tied) == 1 and tied[0][2].bit_count() == 1:  # the common case: one cheapest worker
            _, best_level, bits, _ = tied[0]
            best = order.worker_at(bits.bit_length() - 1)
        else:
            best, best_level = self._tie_broken(order, tied)
        if in_flight is not None and not levels:  # the in-flight worker, holding nothing
            best_level = None
        if levels and weights.stay_margin > 0:
            stay = self._level_that_stays(costed, tokens, best_level, best_cost, num_prompt_tokens)
            if stay is not None:
                stay_level, stay_bit = stay
                best, best_level = order.worker_at(stay_bit.bit_length() - 1), stay_level
        return best, (0 if best_level is None else levels[best_level][0])

    def _tie_broken(self, order: LoadOrder, tied: list) -> tuple[str, int | None]:
        """(worker, level) drawn uniformly among the members of `tied` (_choose's entries of the best
        cost): by level, holders by slot within one, then the load order's groups, each in its
        bucket's order (as a full ranking orders them)."""
        num_tied = sum(entry[2].bit_count() for entry in tied)
        pick = int(self._rng.integers(num_tied)) if num_tied > 1 else 0
        by_level: dict[int, int] = {}  # level -> its tied holders' bits, levels ascending
        for _, level, bits, group in tied:
            if group is None:
                by_level[level] = by_level.get(level, 0) | bits
        for level, bits in by_level.items():
            count = bits.bit_count()
            if pick < count:
                return order.worker_at(bit_positions(bits)[pick]), level
            pick -= count
        for _, _, bits, group in tied:
            if group is not None:
                count = bits.bit_count()
                if pick < count:
                    return order.pick_in(group, pick), None
                pick -= count
        raise AssertionError("the pick is within the tied members")

    def _watch(self, workers: WorkerSet) -> LoadOrder:
        if self._watched is not workers:
            self._order = LoadOrder(lambda key: load_cost(key, self.weights), slot_of=self.index.slot)
            workers.watch(self._order)
            self._watched = workers
        return self._order

    def weights_for(self, num_prompt_tokens: int, longest: float) -> CostWeights:
        """The weights a request is costed with, given the longest prefix of it that a worker holds
        or is computing (tokens). A continuation (that prefix at least `stay_min_cached` of the prompt)
        takes the weights as given. New work behind a short shared prefix (or none) takes a prefill
        weight of `queued_prefill` and no in-flight credit: a worker missing the shared prefix is
        charged the delay of computing it, not a second copy's cost. The copy is made once per
        worker and then serves every later request behind that prefix; charged in full, it kept the
        workers that had missed the first requests from ever getting new work while the holders'
        loads differed by less than the copy (multiturn at load 0.5: one of 16 workers got no
        conversation at all, another 11 of 411, and the busiest 44)."""
        if longest >= self.weights.stay_min_cached * num_prompt_tokens:
            return self.weights
        return self._new_work

    def _in_flight_of(self, request: RouteRequest, levels: list[tuple[int, int]], order: LoadOrder,
                      limit: int) -> tuple[int, object, int, bool] | None:
        """_in_flight from the levels: (the worker's bit, its load key, the prompt tokens it is
        computing, whether it has computed them), when it is eligible and holds the longest indexed
        prefix (or nobody holds any)."""
        if self.pending is None:
            return None
        longest = levels[-1][0] if levels else 0
        wid, extra, computed = self.pending.continuation(request.block_hashes, longest)
        if wid is None:
            return None
        key = order.key_of(wid)
        if key is None:
            return None
        bit = order.bit_of(wid)
        if levels and not levels[-1][1] & bit:
            return None
        tokens = min((longest + extra) * self.block_size, limit) - min(longest * self.block_size, limit)
        return (bit, key, tokens, computed) if tokens > 0 else None

    def _level_that_stays(self, costed: list[tuple[float, int | None, int, object]], tokens: list[int],
                          best_level: int | None, best_cost: float,
                          num_prompt_tokens: int) -> tuple[int, int] | None:
        """Hysteresis (_holder_that_stays) on levels: (level, bit) of the cheapest eligible holder of
        the longest cached prefix (the first by level, then slot, among equal costs), or None.
        `costed`: _choose's entries (cost, level, bits, group)."""
        num_levels = len(tokens)
        held_levels = [entry[1] for entry in costed if entry[1] is not None and entry[1] < num_levels]
        if not held_levels:
            return None
        longest = tokens[max(held_levels)]
        held = 0 if best_level is None else tokens[best_level]
        if held >= longest or longest < self.weights.stay_min_cached * num_prompt_tokens:
            return None
        # the cheapest entry of the levels at that length; the first level among equal costs
        stay_cost, stay_level = min((cost, level) for cost, level, _, _ in costed
                                    if level is not None and level < num_levels and tokens[level] == longest)
        if stay_cost - best_cost > self.weights.stay_margin:
            return None
        members = 0
        for cost, level, bits, _ in costed:
            if level == stay_level and cost == stay_cost:
                members |= bits
        return stay_level, members & -members  # the lowest slot

    def _costs(self, request: RouteRequest, cols, held: dict[int, float],
               overlaps: dict[str, int]) -> np.ndarray:
        """[n] every worker's cost (the in-flight credit included)."""
        cached = np.zeros(len(cols.ids), dtype=np.float64)
        for row, tokens in held.items():
            cached[row] = tokens
        in_flight = self._in_flight(request, cols, overlaps)
        # the in-flight tokens of an eligible worker only, as in _choose
        longest = max(held.values(), default=0.0) + (
            in_flight[1] if in_flight is not None and cols.eligible[in_flight[0]] else 0)
        weights = self.weights_for(request.num_prompt_tokens, longest)
        cost = worker_costs(request.num_prompt_tokens, cached, cols, weights)
        if in_flight is not None:
            cost[in_flight[0]] -= in_flight_credit(weights, in_flight[2]) * in_flight[1]
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


def in_flight_credit(weights: CostWeights, computed: bool) -> float:
    """Per prompt token, the credit of the worker a record of prefixes in flight names: a copy saved
    while it computes them, the prefill itself once the request has ended there (as cached)."""
    return weights.prefill if computed else weights.in_flight
