"""`kvmesh bench offline|latency|serve`: benchmarks (kvmesh/bench). Heavy imports stay in handlers."""

from kvmesh.commands import add_command


def register(subparsers) -> None:
    from kvmesh.bench import latency, offline  # argparse-level modules: they import torch lazily

    bench = subparsers.add_parser("bench", help="benchmarks: offline throughput, latency, cluster serving")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    sub.required = True
    offline.add_arguments(add_command(sub, "offline", offline.run,
                                      help="engine throughput on nano-vllm's workload vs the hardware floor"))
    latency.add_arguments(add_command(sub, "latency", latency.run,
                                      help="TPOT at batch 1 and TTFT of a 1024-token prompt"))
    from kvmesh.bench import logprob_diff

    logprob_diff.add_arguments(add_command(
        sub, "logprob-diff", logprob_diff.run, description=logprob_diff.__doc__.split("\n\n")[0],
        help="compare two `bench offline --logprobs-out` files token by token"))
    from kvmesh.bench import serve, soak  # both import only argparse-level modules at import time

    serve.add_arguments(add_command(sub, "serve", serve.run, description=serve.__doc__.split("\n\n")[0],
                                    help="open-loop HTTP benchmark of a cluster, per routing policy"))
    soak.add_arguments(add_command(
        sub, "soak", soak.run, description=soak.__doc__.split("\n\n")[0],
        help="bounded mixed load with memory sampling; fails on a lost request or memory growth"))

