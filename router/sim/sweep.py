"""Hit rate and TTFT p99 against offered load, per policy (the figure in docs/ROUTING.md).

    python -m kvmesh.router.sim.sweep --workload tenants --workers 16 --requests 10000 \
        --loads 0.3,0.5,0.7,0.9 --policies round_robin,prefix_approx,kv_events \
        --plot docs/img/load_sweep_tenants.png [--json]
"""

import argparse
import json
import sys

from kvmesh.router.policies import parse_policy_names
from kvmesh.router.sim.cluster import SimConfig
from kvmesh.router.sim.run import run
from kvmesh.router.sim.workloads import make_workload


def sweep(workload: str, policies: list[str], loads: list[float], config: SimConfig,
          num_requests: int) -> dict:
    trace = make_workload(workload, num_requests, seed=config.seed, block_size=config.block_size)
    points = []
    for load in loads:
        report = run(trace, policies, config, load=load)
        points.append({"load": load, "rate_req_s": report["config"]["rate_req_s"],
                       "policies": report["policies"]})
    return {"workload": workload, "workers": config.num_workers, "requests": num_requests,
            "seed": config.seed, "points": points}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hit_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    loads = [p["load"] for p in result["points"]]
    policies = list(result["points"][0]["policies"])
    for name in policies:
        hit_ax.plot(loads, [p["policies"][name]["hit_rate"] for p in result["points"]], "o-", label=name)
        ttft_ax.plot(loads, [p["policies"][name]["ttft_p99_s"] * 1e3 for p in result["points"]], "o-",
                     label=name)
    hit_ax.plot(loads, [p["policies"][policies[0]]["oracle_hit_rate"] for p in result["points"]], "k--",
                lw=1, label="oracle")
    hit_ax.set_xlabel("offered load (fraction of estimated capacity)")
    hit_ax.set_ylabel("prefix hit rate")
    ttft_ax.set_xlabel("offered load (fraction of estimated capacity)")
    ttft_ax.set_ylabel("TTFT p99 (ms)")
    ttft_ax.set_yscale("log")
    for ax in (hit_ax, ttft_ax):
        ax.grid(True, which="both", alpha=0.3)
    hit_ax.legend()
    fig.suptitle(f"{result['workload']}, {result['workers']} workers, {result['requests']} requests, "
                 f"seed {result['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.router.sim.sweep")
    p.add_argument("--workload", default="tenants")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--loads", default="0.3,0.5,0.7,0.9")
    p.add_argument("--policies", default="round_robin,prefix_approx,kv_events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PATH.png")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    result = sweep(args.workload, parse_policy_names(args.policies), loads,
                   SimConfig(num_workers=args.workers, seed=args.seed), args.requests)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        for point in result["points"]:
            for name, m in point["policies"].items():
                print(f"load {point['load']:.2f}  {name:14s} hit {m['hit_rate']:.3f} "
                      f"(oracle {m['oracle_hit_rate']:.3f})  ttft p99 {m['ttft_p99_s'] * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
