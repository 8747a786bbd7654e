"""Human-readable tables and the TTFT figures of a `kvmesh sim` run, on one seed or over several."""

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
    return "\n".join(lines + _aligned(rows))


def _aligned(rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell: the first (names) to the left, numbers to the right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]


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


# Over seeds: the metrics the issue judges a policy by; each shown as mean [95% interval].
_SEED_COLUMNS = [m for m in _COLUMNS if m[0] in ("hit_rate", "ttft_p50_s", "ttft_p99_s",
                                                  "throughput_tok_s", "decision_p99_us")]


def format_seeds_table(report: dict) -> str:
    """Per policy the mean [95% interval] over seeds, then each policy minus the reference by seed."""
    cfg = report["config"]
    seeds = report["seeds"]
    load = f"load {cfg['load']:.2f}" if cfg["load"] is not None else f"{cfg['rate_req_s']:.1f} req/s"
    lines = [f"{cfg['workload']} on {cfg['workers']} workers: {cfg['requests']} requests, {load}, "
             f"{len(seeds)} seeds ({_seed_list(seeds)}); mean [95% t-interval]"]
    lines += _interval_rows(report["summary"])
    if report["paired"]:
        lines += ["", "minus kv_events, paired by seed (an interval excluding 0 is a real difference)"]
        lines += _interval_rows(report["paired"], signed=True)
    return "\n".join(lines)


def _interval_rows(table: dict, signed: bool = False) -> list[str]:
    rows = [["policy"] + [h for _, h, _ in _SEED_COLUMNS]]
    for name, metrics in table.items():
        cells = [name]
        for m, _, fmt in _SEED_COLUMNS:
            scale = _SCALE.get(m, 1)
            iv = metrics[m]
            num = fmt.replace("{:", "{:+") if signed else fmt
            cells.append(f"{num.format(iv['mean'] * scale)} [{fmt.format(iv['lo'] * scale)}, "
                         f"{fmt.format(iv['hi'] * scale)}]")
        rows.append(cells)
    return _aligned(rows)


def _seed_list(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))


def plot_ttft_p99_intervals(report: dict, path: str) -> None:
    """TTFT p99 per policy: mean over seeds with its 95% interval as an error bar, each seed a dot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["summary"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for x, name in enumerate(names):
        iv = report["summary"][name]["ttft_p99_s"]
        ax.errorbar([x], [iv["mean"] * 1e3], yerr=[[(iv["mean"] - iv["lo"]) * 1e3], [(iv["hi"] - iv["mean"]) * 1e3]],
                    fmt="o", capsize=6, color="C0")
        dots = [r["policies"][name]["ttft_p99_s"] * 1e3 for r in report["per_seed"]]
        ax.plot([x + 0.15] * len(dots), dots, ".", color="grey", alpha=0.6)
    cfg = report["config"]
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p99 (ms), mean and 95% interval")
    load = f"load {cfg['load']:.2f}" if cfg["load"] is not None else f"{cfg['rate_req_s']:.0f} req/s"
    ax.set_title(f"TTFT p99 over {len(report['seeds'])} seeds: {cfg['workload']}, {cfg['workers']} workers, {load}")
    ax.grid(True, which="both", axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
