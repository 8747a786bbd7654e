"""`kvmesh sim`: judge routing policies on a simulated cluster (kvmesh.router.sim)."""

import argparse
import ast
import json
import os
import sys

from kvmesh.commands import add_command

WORKLOAD_CHOICES = ("tenants", "multiturn", "prefix_repetition", "random")


def register(subparsers) -> None:
    p = add_command(subparsers, "sim", _run,
                    help="simulate a cluster of workers and compare routing policies")
    p.add_argument("--workers", type=int, default=16, help="number of workers (default 16)")
    p.add_argument("--policy", default="kv_events",
                   help="a routing policy (kvmesh.router.policies.POLICIES), a comma-separated list of them, "
                        "or all (default kv_events)")
    p.add_argument("--workload", default="tenants", choices=WORKLOAD_CHOICES, help="default tenants")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--load", type=float, default=None,
                      help="offered load as a fraction of the estimated capacity (default 0.7)")
    rate.add_argument("--rate", type=float, default=None, help="offered load in requests/s")
    p.add_argument("--requests", type=int, default=5000, help="requests in the trace (default 5000)")
    seed = p.add_mutually_exclusive_group()
    seed.add_argument("--seed", type=int, default=0)
    seed.add_argument("--seeds", metavar="SPEC",
                      help="run every policy on each of several seeds and report the mean and 95%% "
                           "interval: a range 0-9, a list 0,3,5 or a count 10 (seeds 0..9)")
    p.add_argument("--jobs", type=int, default=1,
                   help="with --seeds: run this many seeds at once, each in its own process (the same "
                        "results; decision times then share the CPU) (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PATH.png",
                   help="write a TTFT-per-policy figure (with --seeds: TTFT p99 with interval bars)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks per worker (default: what fits on an H200 after the weights)")
    p.add_argument("--max-batch", type=int, default=128, help="running requests per worker (default 128)")
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="tokens per step (default 8192)")
    p.add_argument("--cap", type=int, default=256,
                   help="router cap: max outstanding requests per worker (default 256; 0 = none)")
    p.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="workload parameter, e.g. num_tenants=64 or suffix_tokens=(64,512); repeatable")
    p.add_argument("--policy-opt", action="append", default=[], metavar="POLICY.KEY=VALUE",
                   help="a policy's option, as routing.policy_options takes it (docs/ROUTING.md "
                        "\"Policies\"): kv_events.pending_requests=1024, a field of a mapping option "
                        "with one more dot: kv_events.weights.stay_margin=4096; repeatable")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--router-copies", type=int, default=0, metavar="N",
                   help="route as the serving cluster does: N RoutingState copies in turn, fed late "
                        "through an EventLog (default 0: one router that sees everything at once)")
    p.add_argument("--report-interval-s", type=float, default=0.05,
                   help="with --router-copies: how often worker loads reach the copies (default 0.05)")
    p.add_argument("--event-delay-s", type=float, default=0.0,
                   help="with --router-copies: how late KV event batches and loads reach the copies "
                        "(default 0)")
    p.add_argument("--loads-with-events", action="store_true",
                   help="with --router-copies: a worker's load also travels with every event batch, "
                        "as the cluster's worker sends it")
    p.add_argument("--autoscale", metavar="POLICY",
                   help="instead of comparing routing policies: run this autoscaling policy (queue, "
                        "kv_pressure, ttft_slo, ...) over a bursty trace whose peak is --load of --workers "
                        "replicas, against a fixed fleet of --workers (cluster/autoscale_sim.py)")
    p.add_argument("--autoscale-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="with --autoscale: an autoscaling config field (min_replicas=0, upscale_delay_s=5, "
                        "ttft_p90_target_s=1.0, ...), startup_s, tick_s, max_ongoing_requests, or the "
                        "burst profile's period_s, burst_s, base_load; repeatable")


def parse_workload_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--workload-opt wants KEY=VALUE, got {pair!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--workload-opt {key}: {value!r} is not a Python literal") from None
    return options


def parse_policy_options(pairs: list[str], policies: list[str]) -> dict[str, dict]:
    """--policy-opt POLICY.KEY[.FIELD]=VALUE pairs -> {policy: options}, each policy's checked as a
    serving config's are (router.policies.policy_options)."""
    from kvmesh.router.policies import POLICY_NAMES, policy_options

    options: dict[str, dict] = {}
    for pair in pairs:
        path, sep, value = pair.partition("=")
        parts = path.split(".")
        if not sep or len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"--policy-opt wants POLICY.KEY=VALUE or POLICY.KEY.FIELD=VALUE, got {pair!r}")
        if parts[0] not in POLICY_NAMES:
            raise ValueError(f"--policy-opt {path}: no policy {parts[0]!r}; choose one of "
                             f"{', '.join(POLICY_NAMES)}")
        if parts[0] not in policies:
            raise ValueError(f"--policy-opt {path}: {parts[0]} is not among the policies run "
                             f"({', '.join(policies)})")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--policy-opt {path}: {value!r} is not a Python literal") from None
        mine = options.setdefault(parts[0], {})
        if len(parts) == 2:
            mine[parts[1]] = parsed
        else:
            mine.setdefault(parts[1], {})[parts[2]] = parsed
    for name, raw in options.items():
        try:
            policy_options(name, raw)
        except ValueError as e:
            raise ValueError(f"--policy-opt {name}.{e}") from None
    return options


def _run(args: argparse.Namespace) -> int:
    """Discrete-event simulation of N workers (H200 / Qwen3-0.6B calibration) routed by the real
    kvmesh router. See docs/ROUTING.md."""
    from kvmesh.router.gc_tuning import tune_gc_for_routing

    tune_gc_for_routing()  # as a cluster's routing process runs (decision times: router/gc_tuning.py)
    from kvmesh.router.sim.cluster import SimConfig
    from kvmesh.router.sim.report import format_table, plot_ttft
    from kvmesh.router.policies import parse_policy_names
    from kvmesh.router.sim.run import run
    from kvmesh.router.sim.stats import parse_seeds

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.jobs > 1 and args.seeds is None:
        raise ValueError("--jobs runs seeds in parallel: give --seeds too")
    if args.rate is not None and args.rate <= 0:
        raise ValueError(f"--rate must be > 0, got {args.rate}")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise ValueError(f"--plot {args.plot}: its folder does not exist")  # before the run, not after
    load = args.load if args.load is not None or args.rate is not None else 0.7
    policies = parse_policy_names(args.policy)
    config = SimConfig(num_workers=args.workers, kv_blocks=args.kv_blocks, max_batch=args.max_batch,
                       max_batched_tokens=args.max_batched_tokens, cap=args.cap or None, seed=args.seed,
                       router_copies=args.router_copies, report_interval_s=args.report_interval_s,
                       event_delay_s=args.event_delay_s, loads_with_events=args.loads_with_events,
                       policy_options=parse_policy_options(args.policy_opt, policies))
    options = parse_workload_options(args.workload_opt)
    if args.autoscale:
        return _run_autoscale(args, config, load, options)
    if args.seeds is not None:
        return _run_seeds(args, policies, config, parse_seeds(args.seeds), load, options)
    try:
        report = run(args.workload, policies, config, num_requests=args.requests, load=load,
                     rate=args.rate, progress=not args.no_progress, workload_options=options,
                     keep_results=bool(args.plot))
    except TypeError as e:  # an unknown --workload-opt key
        raise ValueError(f"workload {args.workload}: {e}") from None
    results = report.pop("results", None)
    if args.plot:
        plot_ttft(results, report, args.plot)
    return _emit(args, report, format_table, "TTFT figure")


def _run_seeds(args: argparse.Namespace, policies: list[str], config, seeds: list[int], load,
               options: dict) -> int:
    from kvmesh.router.sim.report import format_seeds_table, plot_ttft_p99_intervals
    from kvmesh.router.sim.run import run_seeds

    try:
        report = run_seeds(args.workload, policies, config, seeds, num_requests=args.requests, load=load,
                           rate=args.rate, progress=not args.no_progress, workload_options=options,
                           jobs=args.jobs)
    except TypeError as e:  # an unknown --workload-opt key
        raise ValueError(f"workload {args.workload}: {e}") from None
    if args.plot:
        plot_ttft_p99_intervals(report, args.plot)
    return _emit(args, report, format_seeds_table, "TTFT p99 figure")


def _run_autoscale(args: argparse.Namespace, config, load, options: dict) -> int:
    from kvmesh.cluster.autoscale_sim import format_autoscale_table, run_from_options
    from kvmesh.router.sim.workloads import make_workload

    workload = make_workload(args.workload, args.requests, seed=args.seed,
                             block_size=config.block_size, **options)
    report = run_from_options(workload, args.autoscale, config, load, args.rate,
                              parse_workload_options(args.autoscale_opt))
    return _emit(args, report, format_autoscale_table, "")


def _emit(args: argparse.Namespace, report: dict, format_report, figure: str) -> int:
    """The report as one JSON object (--json) or as a table, naming the figure written."""
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
        if args.plot:
            print(f"{figure}: {args.plot}")
    return 0
