"""round_robin: the next eligible worker in turn (the baseline every router beats or ties)."""

from collections.abc import Sequence

import numpy as np

from kvmesh.router.policies.base import Policy, RouteRequest, ranked_order
from kvmesh.router.workers import WorkerState, columns_of


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self):
        self._counter = 0

    def rank(self, request: RouteRequest, workers: Sequence[WorkerState]) -> list[str]:
        cols = columns_of(workers)
        eligible = np.flatnonzero(cols.eligible)
        if not len(eligible):
            return ranked_order([], cols)
        start = self._counter % len(eligible)
        self._counter += 1
        return ranked_order(np.roll(eligible, -start), cols)
