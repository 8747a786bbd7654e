"""least_loaded: fewest outstanding requests, then fewest queued prefill tokens; ties at random."""

from collections.abc import Sequence

from kvmesh.router.policies.base import RouteRequest, SeededPolicy, rank_by_score
from kvmesh.router.workers import WorkerState, columns_of


class LeastLoadedPolicy(SeededPolicy):
    name = "least_loaded"

    def rank(self, request: RouteRequest, workers: Sequence[WorkerState]) -> list[str]:
        cols = columns_of(workers)
        # Queued prefill tokens break ties between equal request counts (a fraction of one request).
        score = cols.outstanding + cols.waiting_prefill_tokens / (1.0 + cols.waiting_prefill_tokens.max())
        return rank_by_score(score, cols, self._rng)
