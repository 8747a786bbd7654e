"""Run one workload through the simulated cluster under one or several policies (the same trace for
each) and collect the metrics: what `kvmesh sim` prints."""

import dataclasses
import sys
from collections.abc import Callable

from kvmesh.router.sim.capacity import capacity_req_s
from kvmesh.router.sim.cluster import SimConfig, simulate
from kvmesh.router.sim.metrics import METRICS, oracle_hit_rate, summarize
from kvmesh.router.sim.stats import paired_differences, summarize_seeds
from kvmesh.router.sim.workloads import Workload, assign_arrivals, make_workload


def run(workload: str | Workload, policies: list[str], config: SimConfig, num_requests: int = 5000,
        load: float | None = 0.7, rate: float | None = None, progress: bool = False,
        workload_options: dict | None = None, keep_results: bool = False,
        after_each: Callable[[str], None] | None = None) -> dict:
    """{"policies": {name: metrics}, "config": {...}}; with keep_results, also "results":
    {name: SimResult} (not JSON). `after_each(policy)` is called as each policy's run ends."""
    if (load is None) == (rate is None):
        raise ValueError("give exactly one of load or rate")
    if load is not None and load <= 0:
        raise ValueError(f"load must be > 0, got {load}")
    if isinstance(workload, str):
        workload = make_workload(workload, num_requests, seed=config.seed,
                                 block_size=config.block_size, **(workload_options or {}))
    capacity = capacity_req_s(workload, config.cost, config.num_workers, config.max_batch)
    if rate is None:
        rate = load * capacity
    oracle = oracle_hit_rate(workload)
    out: dict = {"policies": {}, "config": _config_dict(workload, config, capacity, load, rate)}
    results = {}
    for name in policies:
        assign_arrivals(workload, rate)
        result = simulate(workload, name, config, progress=progress)
        out["policies"][name] = summarize(result, oracle)
        if keep_results:
            results[name] = result
        if after_each is not None:
            after_each(name)
    if keep_results:
        out["results"] = results
    return out


def run_seeds(workload: str, policies: list[str], config: SimConfig, seeds: list[int],
              num_requests: int = 5000, load: float | None = 0.7, rate: float | None = None,
              progress: bool = False, workload_options: dict | None = None,
              reference: str = "kv_events", jobs: int = 1) -> dict:
    """`run` once per seed (its trace and its router's tie-breaks): {"seeds", "per_seed": [run's
    report], "summary": {policy: {metric: interval}}, "paired": {policy: {metric: interval of
    policy - reference}}, "config": the first seed's config}. jobs > 1 runs that many seeds at once in
    child processes: the same reports (a seed's run is deterministic) except the decision times, which
    then share the CPU."""
    if not seeds:
        raise ValueError("give at least one seed")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    args = [(workload, policies, dataclasses.replace(config, seed=seed), num_requests, load, rate,
             workload_options) for seed in seeds]
    if jobs == 1:
        bar = _seeds_progress(len(seeds) * len(policies), progress)
        per_seed = []
        try:
            for seed, a in zip(seeds, args):
                bar.set_description(f"seed {seed}")
                per_seed.append(_run_one_seed(*a, after_each=lambda _name: bar.update(1)))
        finally:
            bar.close()
    else:
        per_seed = _run_seeds_in_processes(args, jobs, progress)
    return {"seeds": list(seeds), "per_seed": per_seed,
            "summary": summarize_seeds(per_seed, METRICS),
            "paired": paired_differences(per_seed, METRICS, reference),
            "config": per_seed[0]["config"]}


def _run_one_seed(workload, policies, config, num_requests, load, rate, workload_options,
                  after_each=None) -> dict:
    return run(workload, policies, config, num_requests, load=load, rate=rate,
               workload_options=workload_options, after_each=after_each)


def _run_seeds_in_processes(args: list[tuple], jobs: int, progress: bool) -> list[dict]:
    """Seeds in `jobs` child processes (spawned: no state of this process leaks in); the reports in
    seed order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    bar = _seeds_progress(len(args), progress, unit="seed")
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(args)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_run_one_seed, *a) for a in args]
            for f in futures:
                f.add_done_callback(lambda _f: bar.update(1))
            return [f.result() for f in futures]
    finally:
        bar.close()


def _seeds_progress(total: int, enabled: bool, unit: str = "run"):
    from tqdm import tqdm
    # disable=None: no bar when stderr is not a terminal
    return tqdm(total=total, unit=unit, file=sys.stderr, leave=False, disable=None if enabled else True)


def _config_dict(workload: Workload, config: SimConfig, capacity: float, load, rate) -> dict:
    cost = config.cost
    copies = {}
    if config.router_copies:
        copies = {"router_copies": config.router_copies, "report_interval_s": config.report_interval_s,
                  "event_delay_s": config.event_delay_s, "loads_with_events": config.loads_with_events}
    return {
        "workers": config.num_workers,
        "workload": workload.name,
        "workload_params": {k: list(v) if isinstance(v, tuple) else v for k, v in workload.params.items()},
        "requests": len(workload.requests),
        "seed": config.seed,
        "load": load,
        "rate_req_s": rate,
        "capacity_req_s": capacity,
        "mean_prompt_tokens": workload.mean_prompt_tokens(),
        "mean_output_tokens": workload.mean_output_tokens(),
        "block_size": config.block_size,
        "kv_blocks_per_worker": config.blocks_per_worker,
        "max_batch": config.max_batch,
        "max_batched_tokens": config.max_batched_tokens,
        "cap": config.cap,
        "model": dataclasses.asdict(cost.model),
        "hardware": dataclasses.asdict(cost.hardware),
        **copies,
        **({"policy_options": config.policy_options} if config.policy_options else {}),
    }
