"""The discrete-event loop: arrivals are routed by the real `Router`, workers step, their KV events
and loads flow back into that same Router, as they do in the cluster.

Decision latency is the wall-clock time of `Router.route_request(request, limit=1)` (lock, index walk,
policy): the simulator uses only the choice, not the fallbacks of a full ranking.

With `router_copies` > 0 the arrivals are routed instead as the serving cluster routes them: by that
many RoutingState copies in turn (router/routing_state.py, as the cluster's ingress replicas hold),
fed late through an EventLog (copies.py).
"""

import heapq
import sys
import time
from dataclasses import dataclass, field

from kvmesh.router import Router
from kvmesh.router.gc_tuning import freeze_setup
from kvmesh.router.policies import policy_defaults, policy_options
from kvmesh.router.policies.base import RouteRequest
from kvmesh.router.sim.calibration import CostModel
from kvmesh.router.sim.worker import Job, SimWorker
from kvmesh.router.sim.workloads import Workload

_STEP, _ARRIVAL = 0, 1  # a step ending at the same instant as an arrival is processed first


@dataclass(frozen=True)
class SimConfig:
    num_workers: int = 16
    block_size: int = 16
    kv_blocks: int | None = None  # per worker; default: what fits on the modelled GPU
    max_batch: int = 128  # running requests per worker
    max_batched_tokens: int = 8192  # tokens per engine step (decodes + prompt chunks)
    cap: int | None = 256  # router cap: max outstanding requests per worker
    index_max_blocks: int | None = None  # router index bound; default: every worker's pool, no drops
    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)
    # The cluster's router copies (copies.py); 0: one Router that sees every event and load at once.
    router_copies: int = 0
    report_interval_s: float = 0.05  # a worker's load reaches the copies this often
    event_delay_s: float = 0.0  # worker -> hub -> copy: a publication reaches the copies this late
    loads_with_events: bool = False  # the load also travels with every batch (cluster/worker.py)
    # policy name -> its options as a serving config's routing.policy_options gives them
    policy_options: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("num_workers", "max_batch", "max_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"cap must be >= 1, got {self.cap}")
        if self.max_batched_tokens < self.max_batch:
            raise ValueError("max_batched_tokens must be >= max_batch (every decode needs a slot)")
        if self.router_copies < 0:
            raise ValueError(f"router_copies must be >= 0, got {self.router_copies}")
        if self.router_copies and self.report_interval_s <= 0:
            raise ValueError(f"report_interval_s must be > 0, got {self.report_interval_s}")
        if self.event_delay_s < 0:
            raise ValueError(f"event_delay_s must be >= 0, got {self.event_delay_s}")

    @property
    def blocks_per_worker(self) -> int:
        return self.kv_blocks or self.cost.kv_capacity_blocks()


@dataclass
class SimResult:
    policy: str
    jobs: list[Job]
    workers: list[SimWorker]
    decision_ns: list[int]  # wall clock of each routing decision
    violations: int  # routed past the cap while a worker sat idle
    router: Router
    wall_s: float
    peak_outstanding: int = 0  # most requests a worker held right after a routing decision
    # CPU time of the routing thread per decision (the plain simulator only): what a decision costs
    # without the preemption a busy shared machine adds to the wall clock
    decision_cpu_ns: list[int] = field(default_factory=list)


def simulate(workload: Workload, policy: str, config: SimConfig, progress: bool = False,
             routing_state=None, **policy_kwargs) -> SimResult:
    """Run `workload` (arrivals already assigned) through a cluster routed by `policy`.
    `routing_state`: the class of the router copies (default RoutingState), with
    `config.router_copies`; `policy_kwargs` go to the single Router otherwise."""
    if workload.block_size != config.block_size:
        raise ValueError(f"workload hashed with block_size {workload.block_size}, "
                         f"config has {config.block_size}")
    started = time.perf_counter()
    blocks = config.blocks_per_worker
    policy_kwargs = {**policy_options(policy, config.policy_options.get(policy)), **policy_kwargs}
    if "max_blocks_per_worker" in policy_defaults(policy):  # a history bounded per worker: the pool
        policy_kwargs.setdefault("max_blocks_per_worker", blocks)
    router = Router(policy=policy, block_size=config.block_size,
                    max_blocks=config.index_max_blocks or blocks * config.num_workers,
                    seed=config.seed, default_cap=config.cap, **policy_kwargs)
    workers = [SimWorker(f"worker-{i}", config.cost, blocks, config.max_batch, config.max_batched_tokens)
               for i in range(config.num_workers)]
    by_id = {w.worker_id: i for i, w in enumerate(workers)}
    for w in workers:
        router.add_worker(w.worker_id)
        router.update_load(w.load(0.0))
    copies = None
    if config.router_copies:
        from kvmesh.router.sim.copies import RouterCopies

        extra = {"state_class": routing_state} if routing_state is not None else {}
        copies = RouterCopies(config, policy, workers, policy_options=policy_kwargs, **extra)
        router = copies.router
    versions = [0] * len(workers)
    followups: dict[int, list] = {}
    heap: list = []
    order = 0
    for r in workload.requests:
        if r.after is None:
            heap.append((r.arrival, _ARRIVAL, order, r))
            order += 1
        else:
            followups.setdefault(r.after, []).append(r)
    heapq.heapify(heap)
    freeze_setup()  # the trace and the simulated workers: no part of a router process's heap

    jobs: list[Job] = []
    decision_ns: list[int] = []
    decision_cpu_ns: list[int] = []
    violations = peak = 0
    cap = config.cap
    bar = _progress(len(workload.requests), policy, progress)

    def publish(w: SimWorker, now: float) -> None:
        if copies is not None:
            copies.on_step_end(w, now)
            return
        batch = w.take_event_batch(now)
        if batch is not None and not router.on_events(batch):
            raise AssertionError(f"simulated worker {w.worker_id} sent a batch out of order")
        router.update_load(w.load(now))

    while heap:
        if copies is not None and copies.next_time() <= heap[0][0]:
            copies.fire()
            continue
        now, kind, _, payload = heapq.heappop(heap)
        if kind == _ARRIVAL:
            request = payload
            if copies is not None:
                chosen, elapsed = copies.route(request.prompt_hashes(config.block_size),
                                               request.prompt_len, request.session_key, now,
                                               request_id=request.request_id)
                decision_ns.append(elapsed)
            else:
                route_request = RouteRequest(request.prompt_hashes(config.block_size),
                                             request.prompt_len, request.session_key)
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                chosen = router.route_request(route_request, limit=1)[0]
                decision_ns.append(time.perf_counter_ns() - t0)
                decision_cpu_ns.append(time.thread_time_ns() - c0)
            i = by_id[chosen]
            w = workers[i]
            if cap is not None and w.outstanding >= cap and min(x.outstanding for x in workers) == 0:
                violations += 1
            job = Job(request=request, arrival=now)
            jobs.append(job)
            end = w.submit(job, now)
            peak = max(peak, w.outstanding)
            publish(w, now)
        else:
            i, version = payload
            if version != versions[i]:
                continue
            w = workers[i]
            _, finished, end = w.on_step_end(now)
            publish(w, now)
            for job in finished:
                bar.update(1)
                if copies is not None:
                    copies.finished(job.request.request_id, now)
                for child in followups.pop(job.request.request_id, ()):
                    child.arrival = now + child.think_time_s
                    heapq.heappush(heap, (child.arrival, _ARRIVAL, order, child))
                    order += 1
        if end is not None:
            versions[i] += 1
            heapq.heappush(heap, (end, _STEP, order, (i, versions[i])))
            order += 1
    bar.close()
    return SimResult(policy, jobs, workers, decision_ns, violations, router,
                     time.perf_counter() - started, peak, decision_cpu_ns)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, policy: str, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=f"sim {policy}", unit="req", file=sys.stderr, leave=False,
                mininterval=0.5, disable=None)  # disable=None: no bar when stderr is not a terminal
