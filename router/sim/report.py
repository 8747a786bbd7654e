"""Human-readable table and the TTFT-per-policy figure of a `kvmesh sim` run."""

from kvmesh.router.sim.metrics import METRICS

_COLUMNS = [  # (metric, header, format)
    ("hit_rate", "hit", "{:.3f}"),
    ("oracle_hit_rate", "oracle", "{:.3f}"),
    ("ttft_p50_s", "ttft p50 ms", "{:.1f}"),
    ("ttft_p99_s", "ttft p99 ms", "{:.1f}"),
    ("e2e_p50_s", "e2e p50 s", "{:.3f}"),
    ("e2e_p99_s", "e2e p99 s", "{:.3f}"),
    ("throughput_tok_s", "tok/s", "{:,.0f}"),
    ("imbalance", "imbal", "{:.3f}"),
    ("decision_p50_us", "dec p50 us", "{:.1f}"),
    ("decision_p99_us", "dec p99 us", "{:.1f}"),
    ("index_bytes", "index MB", "{:.1f}"),
]
_SCALE = {"ttft_p50_s": 1e3, "ttft_p99_s": 1e3, "index_bytes": 1e-6}
assert {c[0] for c in _COLUMNS} == set(METRICS)


def format_table(report: dict) -> str:
    cfg = report["config"]
    load = f"load {cfg['load']:.2f} = " if cfg["load"] is not None else ""
    lines = [f"{cfg['workload']} on {cfg['workers']} workers: {cfg['requests']} requests, "
             f"{load}{cfg['rate_req_s']:.1f} req/s (capacity ~{cfg['capacity_req_s']:.1f} req/s), "
             f"prompt {cfg['mean_prompt_tokens']:.0f} / output {cfg['mean_output_tokens']:.0f} tokens, "
             f"seed {cfg['seed']}"]
    header = ["policy"] + [h for _, h, _ in _COLUMNS]
    rows = [header]
    for name, metrics in report["policies"].items():
        rows.append([name] + [fmt.format(metrics[m] * _SCALE.get(m, 1)) for m, _, fmt in _COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def plot_ttft(results: dict, report: dict, path: str) -> None:
    """Empirical CDF of TTFT per policy (log x), one line each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        ttft = np.sort([j.first_token_time - j.arrival for j in result.jobs]) * 1e3
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name)
    cfg = report["config"]
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    load = f"load {cfg['load']:.2f}" if cfg["load"] is not None else f"{cfg['rate_req_s']:.0f} req/s"
    ax.set_title(f"TTFT by policy: {cfg['workload']}, {cfg['workers']} workers, {load}")
    ax.axhline(0.99, color="grey", lw=0.5, ls="--")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
