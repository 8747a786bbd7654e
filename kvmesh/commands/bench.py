"""`kvmesh bench offline|latency|serve`: benchmarks (kvmesh/bench). Heavy imports stay in handlers."""

import argparse
import importlib


def register(subparsers) -> None:
    from kvmesh.bench import latency, offline  # argparse-level modules: they import torch lazily

    bench = subparsers.add_parser("bench", help="benchmarks: offline throughput, latency, cluster serving")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    sub.required = True
    p = sub.add_parser("offline", help="engine throughput on nano-vllm's workload vs the hardware floor",
                       description="Run nano-vllm's benchmark workload through the engine in this process; "
                                   "print output and total tok/s and the ratio to the hardware floor.")
    offline.add_arguments(p)
    p.set_defaults(handler=offline.run)
    p = sub.add_parser("latency", help="TPOT at batch 1 and TTFT of a 1024-token prompt")
    latency.add_arguments(p)
    p.set_defaults(handler=latency.run)
    # serve's options belong to kvmesh/bench/serve.py, imported only when it runs
    p = sub.add_parser("serve", help="open-loop HTTP benchmark of a running cluster (kvmesh/bench/serve.py)",
                       add_help=False)
    p.add_argument("serve_args", nargs=argparse.REMAINDER)
    p.set_defaults(handler=_serve)
    from kvmesh.bench import soak  # stdlib-only at import

    p = sub.add_parser("soak", help="bounded mixed load with memory sampling; fails on a lost request or memory growth",
                       description=soak.__doc__.split("\n\n")[0])
    soak.add_arguments(p)
    p.set_defaults(handler=soak.run)


def _serve(args) -> int:
    try:
        serve = importlib.import_module("kvmesh.bench.serve")
    except ImportError as e:  # ValueError: the CLI prints it as one line (also under python -m kvmesh.cli)
        raise ValueError(f"kvmesh bench serve is not available in this build ({e})") from e
    parser = argparse.ArgumentParser(prog="kvmesh bench serve")
    serve.add_arguments(parser)
    return serve.run(parser.parse_args(args.serve_args))
