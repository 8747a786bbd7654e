"""What `kvmesh status` shows: one row per worker replica from the loads and counters the workers
publish to the KV event hub (the same numbers /metrics exports); what /health and gRPC Health
answer from the same loads; and how the ingress asks the hub for them (HubLoads)."""

import asyncio
import logging
from dataclasses import dataclass

from kvmesh.protocol import WorkerLoad

logger = logging.getLogger("kvmesh.cluster")

# How long /metrics and /v1/kvmesh/workers wait for the KV event hub's loads. Ray queues calls to
# a hub that is restarting, and a stalled one never answers: unbounded, a scrape would hang past
# Prometheus's own timeout (10 s by default) and lose the ingress's request metrics with it.
HUB_TIMEOUT_S = 2.0

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
    status: str  # "ok", "scaled_to_zero", "no_workers" or "kv_event_hub_unavailable"
    workers: int  # healthy worker replicas
    serving: bool  # a request sent now is answered (at zero: once a replica has started)

    @property
    def http_status(self) -> int:
        return 200 if self.serving else 503

    def body(self) -> dict:
        return {"status": self.status, "workers": self.workers}


def cluster_health(loads: dict[str, WorkerLoad] | None, scales_to_zero: bool) -> Health:
    """Healthy workers: ok. None at all where autoscaling may go to zero replicas: the deployment
    is scaled to zero, and a request starts one (a load balancer must keep sending, or it never
    wakes). Otherwise (none yet, or all of them failed): no_workers, 503. `loads` None (the KV
    event hub did not answer within HUB_TIMEOUT_S, HubLoads): kv_event_hub_unavailable, 503, as
    the workers' health is unknown, rather than a probe left waiting."""
    if loads is None:
        return Health("kv_event_hub_unavailable", 0, False)
    healthy = sum(1 for load in loads.values() if load.healthy)
    if healthy:
        return Health("ok", healthy, True)
    if scales_to_zero and not loads:
        return Health("scaled_to_zero", 0, True)
    return Health("no_workers", 0, False)


class HubLoads:
    """The workers' loads and counters as the KV event hub holds them, asked with a bound.

    `get()` is None when the hub did not answer within timeout_s or failed (restarting, stalled,
    or killed for good): the caller answers without them. A failure is logged once per streak of
    failures, and the next call asks for the hub by name again (`get_hub`), since a handle to an
    actor killed for good stays dead while the hub is created again (event_hub.get_or_create_hub).
    Any exception counts as a failure, as in shared_metrics.publish_forever: whatever went wrong,
    the hub's numbers are missing and the ingress's own are still good."""

    def __init__(self, get_hub, name: str, timeout_s: float = HUB_TIMEOUT_S, hub=None):
        self._get_hub, self.name, self.timeout_s, self._hub = get_hub, name, timeout_s, hub
        self.failing = False
        self.problem = ""  # what the last failure was, for error answers

    async def get(self) -> tuple[dict, dict] | None:
        try:
            if self._hub is None:
                self._hub = self._get_hub()
            loads, stats = await asyncio.wait_for(self._hub.loads.remote(), self.timeout_s)
        except Exception as e:  # noqa: BLE001 (see the class docstring)
            self.problem = (f"did not answer within {self.timeout_s:g} s"
                            if isinstance(e, TimeoutError) else f"failed: {type(e).__name__}")
            if not self.failing:
                logger.warning("kvmesh ingress: the KV event hub %s %s; /metrics leaves out the "
                               "worker gauges and /v1/kvmesh/workers answers 503 until it answers "
                               "(logged once until then): %r", self.name, self.problem, e)
            self._hub, self.failing = None, True
            return None
        if self.failing:
            logger.info("kvmesh ingress: the KV event hub %s answers again", self.name)
        self.failing = False
        return loads, stats

    def unavailable_message(self) -> str:
        return (f"the KV event hub (Ray actor {self.name}) {self.problem}: the workers' loads are "
                "unknown until it answers (it restarts by itself; try again in a few seconds)")
