"""Estimated capacity of a simulated cluster for a workload, so that `--load 0.7` means 70% of it.

Per request, a worker spends the prefill of its uncached prompt tokens (compute-bound: the prefill
time of the CostModel) plus its share of the decode steps it rides in, at a full batch of
`max_batch` requests of its context length. The uncached tokens are those the trace's oracle leaves
uncached: capacity is what a router that always found the prefix could serve. Summing prefill and
decode ignores that a real step overlaps them, so the estimate errs low.
"""

import numpy as np

from kvmesh.router.sim.calibration import CostModel
from kvmesh.router.sim.workloads import Workload


def oracle_cached_tokens(workload: Workload) -> np.ndarray:
    """[num requests] prompt tokens cached under the oracle (unlimited cache, seen once = cached)."""
    bs = workload.block_size
    seen: set[int] = set()
    cached = np.zeros(len(workload.requests))
    for r in sorted(workload.requests, key=lambda r: (r.start_offset, r.request_id)):
        limit = (r.prompt_len - 1) // bs
        hashes = r.hashes.tolist()
        n = 0
        while n < limit and hashes[n] in seen:
            n += 1
        cached[r.request_id] = n * bs
        seen.update(hashes)
    return cached


def service_time_s(workload: Workload, cost: CostModel, max_batch: int) -> float:
    """Mean worker-seconds one request of the workload costs."""
    cached = oracle_cached_tokens(workload)
    total = 0.0
    for r, c in zip(workload.requests, cached):
        new = r.prompt_len - int(c)
        prefill = cost.prefill_time(new, int(c)) - cost.hardware.step_overhead_s
        context = r.prompt_len + r.output_len / 2
        decode = r.output_len * cost.decode_step_time(max_batch, int(max_batch * context)) / max_batch
        total += prefill + decode
    return total / len(workload.requests)


def capacity_req_s(workload: Workload, cost: CostModel, num_workers: int, max_batch: int) -> float:
    """Requests per second the cluster can serve (estimate)."""
    return num_workers / service_time_s(workload, cost, max_batch)
