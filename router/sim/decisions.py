"""Routing decisions inside the simulator, by cluster size: what a decision costs while the index grows
and churns with real events and loads change between decisions (not isolated calls on a prebuilt
index: that is kvmesh.router.sim.scale).

    python -m kvmesh.router.sim.decisions --workers 16,256,1024,4096 --workloads tenants,multiturn \\
        --seeds 100-102 --requests 20000 --load 0.7 [--jobs 4] [--json]
    python -m kvmesh.router.sim.decisions --profile --workers 1024 --workloads tenants --seeds 100-100

One `kvmesh sim` run of kv_events per (workers, workload, seed), each in its own process (`--jobs`
at a time); a row per run: decision wall p50 / p99 / p99.9 / max and CPU p50 / p99 (the routing thread's
time: a busy machine does not inflate it), hit rate, TTFT p99, the collections of Python's garbage
collector during the simulation's event loop, where the decisions are (gc.callbacks: count,
longest, total ms; the setup's are left out), and the machine's 1-minute load
average as the run ended. Runs side by side share the machine's caches: use --jobs 1 for figures.

--profile times the phases of every decision of one run (index walk, in-flight lookup, load order,
cost, hysteresis, pending record; phases of older trees where they exist) and the work between decisions (event batches, load
updates) by wrapping those functions with a clock: each wrapper adds ~0.2 us to what it wraps, so
the phases are read as shares, the run's own figures without --profile. Each phase is also given
for the slowest 1% of decisions by CPU time (what the p99 is made of; preempted ones left out): its
mean time within them and its share of their time.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvmesh.router.gc_tuning import tune_gc_for_routing

# (label, module, attribute path): the decision's phases, then the work between decisions. Missing
# attributes are skipped, so the same profile runs on an older tree.
PHASES = [
    ("decision (Router.route_request)", "kvmesh.router.router", "Router.route_request"),
    ("choice (KVEventsPolicy._choose)", "kvmesh.router.policies.kv_events", "KVEventsPolicy._choose"),
    ("index walk (KVIndex.levels)", "kvmesh.router.index", "KVIndex.levels"),
    ("index walk (KVIndex.overlap)", "kvmesh.router.index", "KVIndex.overlap"),
    ("holders -> rows, incl. walk", "kvmesh.router.policies.kv_events", "KVEventsPolicy._holdings"),
    ("in-flight lookup", "kvmesh.router.policies.kv_events", "KVEventsPolicy._in_flight"),
    ("in-flight lookup (levels)", "kvmesh.router.policies.kv_events", "KVEventsPolicy._in_flight_of"),
    ("load order (LoadOrder.cheapest)", "kvmesh.router.load_order", "LoadOrder.cheapest"),
    ("load order (LoadOrder.cheapest_in)", "kvmesh.router.load_order", "LoadOrder.cheapest_in"),
    ("cost (worker_costs)", "kvmesh.router.policies.kv_events", "worker_costs"),
    ("cost of a group (worker_cost)", "kvmesh.router.policies.kv_events", "worker_cost"),
    ("tie broken (_tie_broken)", "kvmesh.router.policies.kv_events", "KVEventsPolicy._tie_broken"),
    ("tied member (LoadOrder.pick_in)", "kvmesh.router.load_order", "LoadOrder.pick_in"),
    ("sort + tie (order_by_score)", "kvmesh.router.policies.kv_events", "order_by_score"),
    ("ids of the ranking (ids_at)", "kvmesh.router.workers", "LoadColumns.ids_at"),
    ("spill-over", "kvmesh.router.policies.kv_events", "spill_over"),
    ("hysteresis (_holder_that_stays)", "kvmesh.router.policies.kv_events", "KVEventsPolicy._holder_that_stays"),
    ("hysteresis (_level_that_stays)", "kvmesh.router.policies.kv_events", "KVEventsPolicy._level_that_stays"),
    ("pending record", "kvmesh.router.pending", "PendingPrefixes.record"),
    ("between: event batches (on_events)", "kvmesh.router.router", "Router.on_events"),
    ("between: load updates (update_load)", "kvmesh.router.router", "Router.update_load"),
]


def _config(workers: int, seed: int):
    from kvmesh.router.sim.cluster import SimConfig
    return SimConfig(num_workers=workers, seed=seed)


def measure(workers: int, workload: str, seed: int, requests: int, load: float) -> dict:
    """One run of kv_events; its decision figures, hit rate and TTFT p99."""
    from kvmesh.router.sim.run import run

    import kvmesh.router.sim.cluster as cluster_module

    # The collections (any generation, by gc.callbacks) of the simulation's event loop, where the
    # decisions are: those of the setup (trace, workers) are dropped when the loop starts.
    pauses_ns: list[int] = []
    started = [0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
        else:
            pauses_ns.append(time.perf_counter_ns() - started[0])

    freeze_setup = cluster_module.freeze_setup

    def loop_starts() -> bool:
        frozen = freeze_setup()
        pauses_ns.clear()
        return frozen

    gc.callbacks.append(on_collection)
    cluster_module.freeze_setup = loop_starts
    try:
        report = run(workload, ["kv_events"], _config(workers, seed), num_requests=requests, load=load)
    finally:
        cluster_module.freeze_setup = freeze_setup
        gc.callbacks.remove(on_collection)
    m = report["policies"]["kv_events"]
    keys = ("decision_p50_us", "decision_p99_us", "decision_p999_us", "decision_max_us",
            "decision_cpu_p50_us", "decision_cpu_p99_us", "hit_rate", "ttft_p99_s", "wall_s")
    return {"workers": workers, "workload": workload, "seed": seed, "requests": requests, "load": load,
            **{k: m.get(k) for k in keys}, "gc_collections": len(pauses_ns),
            "gc_max_ms": max(pauses_ns, default=0) / 1e6, "gc_total_ms": sum(pauses_ns) / 1e6,
            "loadavg_1m": os.getloadavg()[0]}


def profile(workers: int, workload: str, seed: int, requests: int, load: float) -> dict:
    """One run with every phase of PHASES wrapped by a clock: {label: {calls, per_decision, mean_us,
    p50_us, p99_us, share}}, share = the phase's total time / the decisions' total time."""
    import importlib

    times: dict[str, list[int]] = defaultdict(list)
    # the decision each phase's call fell in (-1: between decisions), for the slowest decisions' shares
    during: dict[str, list[int]] = defaultdict(list)
    decision_no = [-1]
    decision_cpu: list[int] = []  # each decision's thread CPU time: picks the slowest (not preemption)
    undo = []
    for label, module_name, path in PHASES:
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is None or not hasattr(owner, name):
            continue
        original = getattr(owner, name)
        if label == PHASES[0][0]:
            timed = _timed(original, times[label], during[label], decision_no, cpu=decision_cpu)
        else:
            timed = _timed(original, times[label], during[label], decision_no)
        setattr(owner, name, timed)
        undo.append((owner, name, original))
    try:
        result = measure(workers, workload, seed, requests, load)
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
    decisions = np.array(times[PHASES[0][0]], dtype=np.float64)
    total = decisions.sum()
    # the slowest 1% of decisions by CPU time (preemption left out): what their time is spent on
    slow = np.zeros(len(decisions), dtype=bool)
    slow[np.argsort(np.array(decision_cpu))[-max(1, len(decisions) // 100):]] = True
    slow_total = decisions[slow].sum()
    phases = {}
    for label, _, _ in PHASES:
        ns = np.array(times.get(label, []), dtype=np.float64)
        if not len(ns):
            continue
        at = np.array(during[label], dtype=np.intp)
        in_slow = (at >= 0) & slow[np.maximum(at, 0)]
        phases[label] = {"calls": len(ns), "per_decision": len(ns) / len(decisions),
                         "mean_us": ns.mean() / 1e3, "p50_us": np.percentile(ns, 50) / 1e3,
                         "p99_us": np.percentile(ns, 99) / 1e3, "share": ns.sum() / total,
                         "slowest_1pct_mean_us": ns[in_slow].sum() / 1e3 / slow.sum(),
                         "slowest_1pct_share": ns[in_slow].sum() / slow_total}
    return {**result, "phases": phases}


def _timed(fn, sink: list[int], during: list[int], decision_no: list[int],
           cpu: list[int] | None = None):
    """`fn` with its calls' times appended to `sink` and the decision each fell in to `during`
    (with `cpu`: fn is the decision, numbered as it starts, -1 once it has returned, and its thread
    CPU time appended to `cpu`)."""
    clock = time.perf_counter_ns
    if cpu is not None:
        cpu_clock = time.thread_time_ns

        def decision(*args, **kwargs):
            decision_no[0] = len(sink)
            during.append(decision_no[0])
            c0 = cpu_clock()
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                sink.append(clock() - t0)
                cpu.append(cpu_clock() - c0)
                decision_no[0] = -1
        return decision

    def wrapper(*args, **kwargs):
        during.append(decision_no[0])
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(clock() - t0)
    return wrapper


def _run_one(do_profile: bool, workers: int, workload: str, seed: int, requests: int,
             load: float, default_gc: bool = False) -> dict:
    """One run in a fresh interpreter (no run inherits another's heap)."""
    argv = [sys.executable, "-m", "kvmesh.router.sim.decisions", "--json", "--workers", str(workers),
            "--workloads", workload, "--seeds", f"{seed}-{seed}", "--requests", str(requests),
            "--load", str(load), "--in-process"] + (["--profile"] if do_profile else []) + (
            ["--default-gc"] if default_gc else [])
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def format_rows(rows: list[dict]) -> str:
    header = ["workers", "workload", "seed", "p50 us", "p99 us", "p99.9 us", "max us", "cpu p50",
              "cpu p99", "hit", "ttft p99 ms", "gc n / max / sum ms", "load avg"]
    lines = [header]
    def cell(value, fmt: str, scale: float = 1.0) -> str:  # None: a tree whose sim lacks the figure
        return "-" if value is None else fmt.format(value * scale)

    for r in rows:
        lines.append([str(r["workers"]), r["workload"], str(r["seed"]), cell(r["decision_p50_us"], "{:.1f}"),
                      cell(r["decision_p99_us"], "{:.1f}"), cell(r.get("decision_p999_us"), "{:.1f}"),
                      cell(r["decision_max_us"], "{:.0f}"),
                      cell(r["decision_cpu_p50_us"], "{:.1f}"), cell(r["decision_cpu_p99_us"], "{:.1f}"),
                      cell(r["hit_rate"], "{:.4f}"), cell(r["ttft_p99_s"], "{:.1f}", 1e3),
                      _gc_cell(r),
                      cell(r["loadavg_1m"], "{:.2f}")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def _gc_cell(r: dict) -> str:
    if r.get("gc_collections") is None:
        return "-"
    return f"{r['gc_collections']} / {r['gc_max_ms']:.1f} / {r['gc_total_ms']:.1f}"


def format_profile(result: dict) -> str:
    lines = [f"{result['workload']}, {result['workers']} workers, seed {result['seed']}, "
             f"{result['requests']} requests (wrapped: read the shares)"]
    for label, p in result["phases"].items():
        lines.append(f"{label:40s} {p['per_decision']:5.2f}/decision  mean {p['mean_us']:7.1f} us  "
                     f"p50 {p['p50_us']:7.1f}  p99 {p['p99_us']:8.1f}  share {p['share']:6.1%}  "
                     f"slowest 1%: {p['slowest_1pct_mean_us']:7.1f} us {p['slowest_1pct_share']:6.1%}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"--workers wants a comma list of counts >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    from kvmesh.commands.sim import WORKLOAD_CHOICES
    from kvmesh.router.sim.stats import parse_seeds

    p = argparse.ArgumentParser(prog="python -m kvmesh.router.sim.decisions",
                                description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="16,256,1024,4096", help="comma list (default 16,256,1024,4096)")
    p.add_argument("--workloads", default="tenants,multiturn", help="comma list (default tenants,multiturn)")
    p.add_argument("--seeds", default="100-102", help="as kvmesh sim --seeds (default 100-102)")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, one process each (default 1)")
    p.add_argument("--profile", action="store_true", help="time the phases of each decision")
    p.add_argument("--json", action="store_true", help="one JSON object per run, a line each")
    p.add_argument("--default-gc", action="store_true",
                   help="keep CPython's collector thresholds (default: the routing process's, "
                        "kvmesh.router.gc_tuning, as the cluster's router copies run)")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # one run, here
    args = p.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOAD_CHOICES:
            raise ValueError(f"--workloads: unknown workload {w!r}; choose from {', '.join(WORKLOAD_CHOICES)}")
    if args.requests < 1 or args.jobs < 1 or args.load <= 0:
        raise ValueError("--requests and --jobs must be >= 1, --load > 0")
    runs = [(args.profile, n, w, s, args.requests, args.load)
            for n in _int_list(args.workers) for w in workloads for s in parse_seeds(args.seeds)]
    if args.in_process:
        if not args.default_gc:
            tune_gc_for_routing()
        results = [(profile if args.profile else measure)(*run[1:]) for run in runs]
        for r in results:
            r["gc_thresholds"] = list(gc.get_threshold())
    else:
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda run: _run_one(*run, default_gc=args.default_gc), runs))
    if args.json:
        for r in results:
            print(json.dumps(r))
    elif args.profile:
        print("\n\n".join(format_profile(r) for r in results))
    else:
        print(format_rows(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
