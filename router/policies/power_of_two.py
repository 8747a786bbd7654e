"""power_of_two: sample two eligible workers, take the less loaded (Mitzenmacher's two choices)."""

from collections.abc import Sequence

import numpy as np

from kvmesh.router.policies.base import RouteRequest, SeededPolicy, ranked_order
from kvmesh.router.workers import WorkerState, columns_of


class PowerOfTwoPolicy(SeededPolicy):
    name = "power_of_two"

    def rank(self, request: RouteRequest, workers: Sequence[WorkerState]) -> list[str]:
        cols = columns_of(workers)
        eligible = np.flatnonzero(cols.eligible)
        if len(eligible) <= 1:
            return ranked_order(eligible, cols)
        a, b = self._rng.choice(eligible, size=2, replace=False)
        if cols.outstanding[b] < cols.outstanding[a]:
            a, b = b, a
        rest = eligible[(eligible != a) & (eligible != b)]
        rest = rest[np.argsort(cols.outstanding[rest], kind="stable")]
        return ranked_order([a, b, *rest], cols)
