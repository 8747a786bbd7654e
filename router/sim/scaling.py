"""Cluster scaling in the simulator, calibrated to the engine measured on one GPU.

1. Calibration: nano-vllm's offline workload (256 prompts of 100-1024 tokens, 100-1024 output
   tokens, all at t=0) runs through one simulated worker; the hardware model's speed is scaled by one
   factor until the simulated makespan equals the measured one (`kvmesh bench offline`, one H200).
2. Scaling: for 1, 2, 4, 8 workers, throughput at saturation (offered load above capacity) and
   TTFT / prefix hit rate at a fixed per-worker load, per routing policy; efficiency(N) =
   throughput(N) / (N x throughput(1)).

    python -m kvmesh.router.sim.scaling --measured-seconds 6.90 --json > scaling.json

This stands in for the 4- and 8-GPU runs where those machines are not available; it is a model,
and says so wherever its numbers are quoted.
"""

import argparse
import dataclasses
import json
import random
import sys

import numpy as np

from kvmesh.hashing import block_hashes
from kvmesh.router.policies import parse_policy_names
from kvmesh.router.sim.calibration import CostModel, Hardware
from kvmesh.router.sim.cluster import SimConfig, simulate
from kvmesh.router.sim.run import run
from kvmesh.router.sim.workloads import SimRequest, Workload


def nano_vllm_workload(block_size: int = 16, seed: int = 0) -> Workload:
    """The offline benchmark's workload: random prompts and lengths, every arrival at t = 0."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    outputs = [rng.randint(100, 1024) for _ in range(256)]  # 133,966 tokens, as the benchmark checks
    requests = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        tokens = np.array(prompt + [0] * out, dtype=np.int32)
        hashes = np.array(block_hashes(tokens.tolist(), block_size, salt=f"offline-{i}".encode()), dtype=np.uint64)
        requests.append(SimRequest(request_id=i, tokens=tokens, prompt_len=len(prompt), output_len=out,
                                   hashes=hashes))
    return Workload("nano_vllm_offline", requests, block_size, {"num_prompts": 256})


def scaled_cost(speed: float, base: CostModel | None = None) -> CostModel:
    """The base cost model with every rate multiplied (and the fixed overhead divided) by `speed`."""
    base = base or CostModel()
    hw = base.hardware
    return dataclasses.replace(base, hardware=dataclasses.replace(
        hw, copy_bandwidth=hw.copy_bandwidth * speed, matmul_flops=hw.matmul_flops * speed,
        step_overhead_s=hw.step_overhead_s / speed))


def offline_makespan(cost: CostModel, workload: Workload) -> float:
    config = SimConfig(num_workers=1, max_batch=256, max_batched_tokens=16384, cap=None, cost=cost)
    for r in workload.requests:
        r.arrival = 0.0
    result = simulate(workload, "round_robin", config)
    return max(j.finish_time for j in result.jobs)


def calibrate(measured_seconds: float, iterations: int = 18) -> tuple[float, float]:
    """(speed factor, the default model's makespan) such that the makespan matches the measurement."""
    workload = nano_vllm_workload()
    default = offline_makespan(CostModel(), workload)
    low, high = 0.05, 4.0
    for _ in range(iterations):  # the makespan falls monotonically with speed
        mid = (low * high) ** 0.5
        if offline_makespan(scaled_cost(mid), workload) > measured_seconds:
            low = mid
        else:
            high = mid
    return (low * high) ** 0.5, default


def scaling_table(cost: CostModel, workloads: list[str], policies: list[str], sizes: list[int],
                  requests_per_worker: int, load: float, saturation_load: float, seed: int,
                  progress: bool) -> list[dict]:
    rows = []
    for workload in workloads:
        for policy in policies:
            base = None
            for n in sizes:
                config = SimConfig(num_workers=n, seed=seed, cost=cost)
                steady = run(workload, [policy], config, num_requests=requests_per_worker * n, load=load)
                saturated = run(workload, [policy], config, num_requests=requests_per_worker * n,
                                load=saturation_load)
                m, s = steady["policies"][policy], saturated["policies"][policy]
                throughput = s["throughput_tok_s"]
                base = base if base is not None else (throughput, m["hit_rate"])
                rows.append({
                    "workload": workload, "policy": policy, "workers": n,
                    "throughput_tok_s": throughput, "efficiency": throughput / (n * base[0]),
                    "ttft_p50_s": m["ttft_p50_s"], "ttft_p99_s": m["ttft_p99_s"],
                    "hit_rate": m["hit_rate"], "hit_rate_vs_1": m["hit_rate"] / base[1] if base[1] else 0.0,
                    "load": load, "saturation_load": saturation_load,
                })
                if progress:
                    print(f"{workload:10s} {policy:12s} N={n}: {throughput:,.0f} tok/s "
                          f"(eff {rows[-1]['efficiency']:.2f}), hit {m['hit_rate']:.3f}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.router.sim.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--measured-seconds", type=float, default=6.90,
                   help="offline benchmark time measured on one GPU (default: docs/PERF.md, nvidia-h200)")
    p.add_argument("--workloads", default="tenants,multiturn")
    p.add_argument("--policies", default="kv_events,round_robin")
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--requests-per-worker", type=int, default=600)
    p.add_argument("--load", type=float, default=0.7, help="offered load for TTFT and hit rate")
    p.add_argument("--saturation-load", type=float, default=1.5, help="offered load for throughput")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write throughput-vs-workers PNG here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    speed, default_makespan = calibrate(args.measured_seconds)
    cost = scaled_cost(speed)
    rows = scaling_table(cost, args.workloads.split(","), parse_policy_names(args.policies),
                         [int(x) for x in args.sizes.split(",")], args.requests_per_worker,
                         args.load, args.saturation_load, args.seed, progress=not args.json)
    out = {"calibration": {"measured_seconds": args.measured_seconds, "speed_factor": speed,
                           "default_model_seconds": default_makespan,
                           "hardware": dataclasses.asdict(cost.hardware)},
           "rows": rows}
    if args.plot:
        _plot(rows, args.plot)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"calibration: measured {args.measured_seconds:.2f} s offline on one GPU; the default model "
          f"predicts {default_makespan:.2f} s; speed factor {speed:.3f}")
    print(f"{'workload':10s} {'policy':12s} {'N':>2s} {'tok/s':>10s} {'eff':>5s} {'TTFT p50':>9s} "
          f"{'TTFT p99':>9s} {'hit':>6s} {'hit/1':>6s}")
    for r in rows:
        print(f"{r['workload']:10s} {r['policy']:12s} {r['workers']:2d} {r['throughput_tok_s']:10,.0f} "
              f"{r['efficiency']:5.2f} {r['ttft_p50_s'] * 1e3:7.1f}ms {r['ttft_p99_s'] * 1e3:7.1f}ms "
              f"{r['hit_rate']:6.3f} {r['hit_rate_vs_1']:6.3f}")
    return 0


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, workload in zip(axes, sorted({r["workload"] for r in rows})):
        for policy in sorted({r["policy"] for r in rows}):
            pts = [r for r in rows if r["workload"] == workload and r["policy"] == policy]
            ax.plot([r["workers"] for r in pts], [r["throughput_tok_s"] for r in pts], marker="o", label=policy)
        one = [r for r in rows if r["workload"] == workload and r["workers"] == 1]
        if one:
            n = [r["workers"] for r in rows if r["workload"] == workload]
            best = max(r["throughput_tok_s"] for r in one)
            ax.plot(sorted(set(n)), [best * k for k in sorted(set(n))], "k:", label="linear")
        ax.set_title(f"{workload} (simulated, calibrated)")
        ax.set_xlabel("workers")
        ax.set_ylabel("output tok/s at saturation")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
