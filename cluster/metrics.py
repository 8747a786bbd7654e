"""Prometheus metrics of the ingress (GET /metrics); names, types and labels are a contract with the
Grafana dashboard and are documented in docs/METRICS.md.

Request metrics are observed by the ingress as requests finish. Per-worker gauges are read at
scrape time from the KV event hub's latest loads (so a removed worker's series disappear).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WORKER_DEPLOYMENT = "KVWorker"


class _WorkerCollector:
    """Gauges of the workers' latest loads and counters, refreshed before each scrape."""

    def __init__(self):
        self.loads: dict = {}
        self.stats: dict = {}

    def collect(self):
        queue = GaugeMetricFamily("kvmesh_queue_depth", "Requests waiting in a worker's scheduler.", labels=["worker"])
        running = GaugeMetricFamily("kvmesh_running_requests", "Requests running in a worker.", labels=["worker"])
        kv = GaugeMetricFamily("kvmesh_kv_usage_ratio", "Fraction of a worker's KV blocks in use.", labels=["worker"])
        hit = GaugeMetricFamily("kvmesh_prefix_hit_rate", "Cached / prompt tokens of a worker since it started.", labels=["worker"])
        free = GaugeMetricFamily("kvmesh_kv_free_blocks", "Free KV blocks of a worker.", labels=["worker"])
        served = GaugeMetricFamily("kvmesh_worker_requests", "Requests a worker accepted since it started.", labels=["worker"])
        preempted = GaugeMetricFamily("kvmesh_worker_preemptions", "Requests a worker preempted (out of KV blocks; recomputed later) since it started.", labels=["worker"])
        replicas = GaugeMetricFamily("kvmesh_replicas", "Worker replicas reporting to the KV event hub.", labels=["deployment"])
        for wid, load in sorted(self.loads.items()):
            queue.add_metric([wid], load.waiting)
            running.add_metric([wid], load.running)
            kv.add_metric([wid], load.kv_usage)
            free.add_metric([wid], load.kv_free_blocks)
        for wid, s in sorted(self.stats.items()):
            prompt = s.get("prompt_tokens", 0)
            hit.add_metric([wid], s.get("cached_tokens", 0) / prompt if prompt else 0.0)
            served.add_metric([wid], s.get("requests", 0))
            preempted.add_metric([wid], s.get("preemptions", 0))
        replicas.add_metric([WORKER_DEPLOYMENT], len(set(self.loads) | set(self.stats)))
        return [queue, running, kv, hit, free, served, preempted, replicas]


class IngressMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvmesh_requests", "Requests answered, by HTTP status code.", ["model", "status"], registry=r)
        self.ttft = Histogram("kvmesh_request_ttft_seconds", "Time from request arrival to its first token.", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvmesh_request_tpot_seconds", "Mean time per output token after the first.", ["model"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvmesh_request_e2e_seconds", "Time from request arrival to its last token.", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvmesh_prompt_tokens", "Prompt tokens of finished requests.", ["model"], registry=r)
        self.generation_tokens = Counter("kvmesh_generation_tokens", "Tokens generated.", ["model"], registry=r)
        self.cached_tokens = Counter("kvmesh_cached_prompt_tokens", "Prompt tokens served from a worker's prefix cache.", ["model"], registry=r)
        self.retries = Counter("kvmesh_request_retries", "Requests sent again after their worker died.", ["model"], registry=r)
        self.workers = _WorkerCollector()
        r.register(self.workers)

    def init_model(self, model: str) -> None:
        """Export the model's series at 0 from the start (dashboards see them before traffic)."""
        self.requests.labels(model=model, status="200")
        for metric in (self.ttft, self.tpot, self.e2e, self.prompt_tokens, self.generation_tokens,
                       self.cached_tokens, self.retries):
            metric.labels(model=model)

    def observe_status(self, model: str, status: int) -> None:
        self.requests.labels(model=model, status=str(status)).inc()

    def observe_request(self, model: str, arrival: float, first_token: float | None, end: float,
                        prompt_tokens: int, output_tokens: int, cached_tokens: int) -> None:
        if first_token is not None:
            self.ttft.labels(model=model).observe(max(0.0, first_token - arrival))
            if output_tokens > 1:
                self.tpot.labels(model=model).observe(max(0.0, end - first_token) / (output_tokens - 1))
        self.e2e.labels(model=model).observe(max(0.0, end - arrival))
        self.prompt_tokens.labels(model=model).inc(prompt_tokens)
        self.generation_tokens.labels(model=model).inc(output_tokens)
        self.cached_tokens.labels(model=model).inc(cached_tokens)

    def render(self, loads: dict, stats: dict) -> bytes:
        self.workers.loads, self.workers.stats = loads, stats
        return generate_latest(self.registry)
