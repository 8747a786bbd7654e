"""kvmesh.router: prefix-aware routing from exact KV events (docs/ROUTING.md).

Stable API (what the Ray Serve request router builds on):

    from kvmesh.hashing import block_hashes, model_salt
    from kvmesh.router import Router

    router = Router(policy="kv_events", block_size=16)   # thread-safe: one lock inside
    router.add_worker("replica-a", cap=64)               # cap = max outstanding requests (optional)
    router.update_load(load)                              # kvmesh.protocol.WorkerLoad
    if not router.on_events(batch):                       # kvmesh.protocol.KVEventBatch
        router.on_snapshot(fetch_snapshot(batch.worker_id))   # KVSnapshot; False -> fetch again
    hashes = block_hashes(prompt_token_ids, 16, model_salt(model_name))
    ranked = router.route(hashes, len(prompt_token_ids), session_key=None)  # ids, best first
    router.remove_worker("replica-a")

- `on_events` returns False on a gap, a new epoch or a worker first seen mid-stream: fetch that
  worker's snapshot (later batches are buffered meanwhile); `workers_awaiting_snapshot()` lists those
  still waiting. `add_worker` on a known worker changes only its cap (if given).
- `Router(policy, block_size=16, max_blocks=1_000_000, seed=None, default_cap=None, **policy_kwargs)`;
  `route()` returns eligible workers (healthy, below cap) in the policy's order, then full healthy ones
  least-outstanding first (spill-over); never unhealthy ones; [] if none is healthy.
- `KVIndex(max_blocks)`: `apply(batch) -> bool` (False = gap / new epoch: fetch a snapshot),
  `apply_snapshot(snap) -> bool`, `remove_worker(id)`, `overlap(block_hashes, worker_ids=None) ->
  {worker_id: leading cached blocks}` (zeros left out), `num_blocks`, `approx_bytes()`.
- Policies: `make_policy(name, index=..., block_size=..., seed=..., **options)` with `rank(RouteRequest,
  Sequence[WorkerState]) -> list[str]`; names in `POLICY_NAMES`: round_robin, least_loaded,
  power_of_two, session, prefix_approx, kv_events (default). `RouteRequest(block_hashes,
  num_prompt_tokens, session_key=None)`; `WorkerState(worker_id, load: WorkerLoad, healthy, cap)`.
"""

from kvmesh.router.cost import CostWeights
from kvmesh.router.index import KVIndex
from kvmesh.router.policies import DEFAULT_POLICY, POLICY_NAMES, make_policy
from kvmesh.router.policies.base import Policy, RouteRequest
from kvmesh.router.router import Router
from kvmesh.router.workers import WorkerSet, WorkerState

__all__ = ["CostWeights", "DEFAULT_POLICY", "KVIndex", "POLICY_NAMES", "Policy", "RouteRequest",
           "Router", "WorkerSet", "WorkerState", "make_policy"]
