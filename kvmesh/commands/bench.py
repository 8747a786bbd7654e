"""`kvmesh bench offline|latency|serve`: benchmarks (kvmesh/bench). Heavy imports stay in handlers."""


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
    from kvmesh.bench import logprob_diff

    p = sub.add_parser("logprob-diff", help="compare two `bench offline --logprobs-out` files token by token",
                       description=logprob_diff.__doc__.split("\n\n")[0])
    logprob_diff.add_arguments(p)
    p.set_defaults(handler=logprob_diff.run)
    from kvmesh.bench import serve, soak  # both import only argparse-level modules at import time

    p = sub.add_parser("serve", help="open-loop HTTP benchmark of a cluster, per routing policy",
                       description=serve.__doc__.split("\n\n")[0])
    serve.add_arguments(p)
    p.set_defaults(handler=serve.run)

    p = sub.add_parser("soak", help="bounded mixed load with memory sampling; fails on a lost request or memory growth",
                       description=soak.__doc__.split("\n\n")[0])
    soak.add_arguments(p)
    p.set_defaults(handler=soak.run)

