"""What `kvmesh status` shows: one row per worker replica from the loads and counters the workers
publish to the KV event hub (the same numbers /metrics exports); and what /health and gRPC Health
answer from the same loads."""

from dataclasses import dataclass

from kvmesh.protocol import WorkerLoad

COLUMNS = ("worker", "healthy", "running", "waiting", "kv_used", "kv_blocks", "hit_rate", "requests",
           "tokens_out", "preempted", "ttft_p90_s", "step_ms")


def worker_rows(loads: dict[str, WorkerLoad], stats: dict[str, dict]) -> list[dict]:
    rows = []
    for worker_id in sorted(set(loads) | set(stats)):
        load, s = loads.get(worker_id), stats.get(worker_id, {})
        prompt = s.get("prompt_tokens", 0)
        rows.append({
            "worker": worker_id,
            "healthy": bool(load.healthy) if load else False,
            "running": load.running if load else 0,
            "waiting": load.waiting if load else 0,
            "kv_used": round(load.kv_usage, 4) if load else 0.0,
            "kv_blocks": load.kv_total_blocks if load else 0,
            "hit_rate": round(s.get("cached_tokens", 0) / prompt, 4) if prompt else 0.0,
            "requests": s.get("requests", 0),
            "tokens_out": s.get("generation_tokens", 0),
            "preempted": s.get("preemptions", 0),  # requests put back to wait for KV blocks (recomputed)
            "ttft_p90_s": round(s.get("ttft_p90_s", 0.0), 4),
            # mean wall time of an engine step: well above the model's GPU time means the host
            # (scheduling, or the replica's event loop holding the GIL) is the limit
            "step_ms": round(1e3 * s.get("step_seconds", 0.0) / s["steps"], 3) if s.get("steps") else 0.0,
            # the raw counters behind step_ms (not in the table): a sampler takes step times
            # over an interval from their differences (kvmesh bench serve --sample-s)
            "steps": s.get("steps", 0),
            "step_seconds": round(s.get("step_seconds", 0.0), 6),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    cells = [list(COLUMNS)] + [[_cell(c, r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


PERCENT = ("kv_used", "hit_rate")


def _cell(column: str, value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if column in PERCENT:
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


@dataclass(frozen=True)
class Health:
    status: str  # "ok", "scaled_to_zero" or "no_workers"
    workers: int  # healthy worker replicas
    serving: bool  # a request sent now is answered (at zero: once a replica has started)

    @property
    def http_status(self) -> int:
        return 200 if self.serving else 503

    def body(self) -> dict:
        return {"status": self.status, "workers": self.workers}


def cluster_health(loads: dict[str, WorkerLoad], scales_to_zero: bool) -> Health:
    """Healthy workers: ok. None at all where autoscaling may go to zero replicas: the deployment
    is scaled to zero, and a request starts one (a load balancer must keep sending, or it never
    wakes). Otherwise (none yet, or all of them failed): no_workers, 503."""
    healthy = sum(1 for load in loads.values() if load.healthy)
    if healthy:
        return Health("ok", healthy, True)
    if scales_to_zero and not loads:
        return Health("scaled_to_zero", 0, True)
    return Health("no_workers", 0, False)
