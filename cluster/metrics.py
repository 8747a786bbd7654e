"""Prometheus metrics of the ingress (GET /metrics); names, types and labels are a contract with the
Grafana dashboard and are documented in docs/METRICS.md.

Request metrics are observed by the ingress replica as requests finish, and exported summed with
every other ingress replica's (shared_metrics.py). Per-worker gauges are read at scrape time from
the KV event hub's latest loads (so a removed worker's series disappear); a scrape the hub did not
answer leaves them out and says so (`kvmesh_kv_event_hub_up` 0).

Every metric is also exported under vLLM's name and labels (`vllm:...`, `model_name`, per worker
`engine`), so dashboards, alerts and autoscaling rules written for vLLM read a kvmesh cluster.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.cluster.shared_metrics import Samples, WithOthers, samples_of

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WORKER_DEPLOYMENT = "KVWorker"
# vLLM's buckets (vllm/v1/metrics/loggers.py), so quantiles match a vLLM server's
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                      100000)
FINISHED_REASONS = ("stop", "length", "abort")


class _WorkerCollector:
    """Gauges of the workers' latest loads and counters, refreshed before each scrape."""

    def __init__(self):
        self.loads: dict = {}
        self.stats: dict = {}
        self.hub_up = True  # the hub answered this scrape; if not, loads and stats mean nothing
        self.model_name = ""

    def collect(self):
        up = GaugeMetricFamily("kvmesh_kv_event_hub_up", "1 if the KV event hub answered this scrape's request for the workers' loads in time, else 0 (the per-worker gauges and kvmesh_replicas are then left out).", value=int(self.hub_up))
        if not self.hub_up:  # no worker series rather than ones saying there are no workers
            return [up]
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
        return [queue, running, kv, hit, free, served, preempted, replicas, up] + self._vllm()

    def _vllm(self) -> list:
        """The same gauges under vLLM's names: one series per worker (`engine`)."""
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests running on a worker.", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting in a worker's scheduler.", labels=labels)
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of a worker's KV blocks in use (1 = 100%).", labels=labels)
        preempted = CounterMetricFamily("vllm:num_preemptions", "Requests a worker preempted since it started.", labels=labels)
        for wid, load in sorted(self.loads.items()):
            running.add_metric([self.model_name, wid], load.running)
            waiting.add_metric([self.model_name, wid], load.waiting)
            kv.add_metric([self.model_name, wid], load.kv_usage)
        for wid, s in sorted(self.stats.items()):
            preempted.add_metric([self.model_name, wid], s.get("preemptions", 0))
        return [running, waiting, kv, preempted]


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
        self.aborted = Counter("kvmesh_requests_aborted", "Requests aborted before they finished (the client went away, or a gRPC Abort).", ["model"], registry=r)
        self.vllm = _VllmRequestMetrics(r)
        # what this replica observes itself: shared with the other ingress replicas
        self.own = [m for m in (*vars(self).values(), *vars(self.vllm).values())
                    if isinstance(m, (Counter, Histogram))]
        self.others: Samples = {}  # the other ingress replicas' sum, from the hub
        self.workers = _WorkerCollector()
        r.register(self.workers)

    def init_model(self, model: str) -> None:
        """Export the model's series at 0 from the start (dashboards see them before traffic)."""
        self.requests.labels(model=model, status="200")
        for metric in (self.ttft, self.tpot, self.e2e, self.prompt_tokens, self.generation_tokens,
                       self.cached_tokens, self.retries, self.aborted):
            metric.labels(model=model)
        self.vllm.init_model(model)
        self.workers.model_name = model

    def observe_abort(self, model: str, prompt_tokens: int, output_tokens: int,
                      token_gaps: list[float] = ()) -> None:
        """A request that ended before it finished (streamed or not); the gaps between the tokens
        it had made are observed too, as vLLM observes each when it happens."""
        self.aborted.labels(model=model).inc()
        self.vllm.success.labels(model_name=model, finished_reason="abort").inc()
        self.observe_token_gaps(model, token_gaps)

    def observe_token_gaps(self, model: str, token_gaps: list[float]) -> None:
        itl = self.vllm.itl.labels(model_name=model)
        for gap in token_gaps:
            itl.observe(gap)

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

    def observe_engine_times(self, model: str, last, first_token: float | None, end: float,
                             output_tokens: int, prompt_tokens: int, cached_tokens: int,
                             arrival: float, token_gaps: list[float] = ()) -> None:
        """vLLM's request metrics of a finished request; `last` is its last TokenDelta (with the
        worker's arrival, scheduling and first-token times, on the worker's clock); `token_gaps`
        the time between each of its tokens and the one before (TokenGaps), each observed."""
        v, labels = self.vllm, {"model_name": model}
        reason = last.finish_reason if last.finish_reason in FINISHED_REASONS else "stop"
        v.success.labels(finished_reason=reason, **labels).inc()
        v.prompt_tokens.labels(**labels).inc(prompt_tokens)
        v.generation_tokens.labels(**labels).inc(output_tokens)
        v.request_prompt_tokens.labels(**labels).observe(prompt_tokens)
        v.request_generation_tokens.labels(**labels).observe(output_tokens)
        v.prefix_queries.labels(**labels).inc(prompt_tokens)
        v.prefix_hits.labels(**labels).inc(cached_tokens)
        v.e2e.labels(**labels).observe(max(0.0, end - arrival))
        self.observe_token_gaps(model, token_gaps)
        if first_token is not None:
            v.ttft.labels(**labels).observe(max(0.0, first_token - arrival))
            v.decode_time.labels(**labels).observe(max(0.0, end - first_token))
        if last.scheduled_time is not None and last.arrival_time:
            v.queue_time.labels(**labels).observe(max(0.0, last.scheduled_time - last.arrival_time))
            if last.first_token_time is not None:
                prefill = max(0.0, last.first_token_time - last.scheduled_time)
                v.prefill_time.labels(**labels).observe(prefill)
                if first_token is not None:
                    v.inference_time.labels(**labels).observe(prefill + max(0.0, end - first_token))

    def own_samples(self) -> Samples:
        return samples_of(self.own)

    def render(self, loads: dict, stats: dict, hub_up: bool = True) -> bytes:
        """The scrape's text; hub_up False: the hub did not answer, so no worker series."""
        self.workers.loads, self.workers.stats, self.workers.hub_up = loads, stats, hub_up
        return generate_latest(WithOthers(self.registry, self.others))


MAX_ITL_OBSERVATIONS = 4096  # per request: bounds the work (and memory) of one very long output


class TokenGaps:
    """The gaps between a request's consecutive tokens, per sequence (n > 1), from the times the
    worker sampled them (TokenDelta.token_times): vLLM's inter-token latencies, one per gap."""

    def __init__(self):
        self.gaps: list[float] = []
        self._last: dict[int, float] = {}  # sequence index -> when its last token was sampled

    def add(self, delta) -> None:
        for sampled_at in delta.token_times or ():
            last = self._last.get(delta.index)
            if last is not None and len(self.gaps) < MAX_ITL_OBSERVATIONS:
                self.gaps.append(max(0.0, sampled_at - last))
            self._last[delta.index] = sampled_at


class _VllmRequestMetrics:
    """vLLM's request metrics (names, types, `model_name` label), observed by the ingress."""

    def __init__(self, r: CollectorRegistry):
        m = ["model_name"]
        self.success = Counter("vllm:request_success", "Finished requests, by finished_reason (stop, length, abort).", m + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.", m, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", m, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", m, buckets=VLLM_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Generated tokens per request.", m, buckets=VLLM_TOKEN_BUCKETS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token.", m, buckets=VLLM_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens of a request (each gap, from the worker's sampling times).", m, buckets=VLLM_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", m, buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time a request waited in a worker's scheduler before it was first scheduled.", m, buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Time from first scheduled to the first token.", m, buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "Time from the first token to the last.", m, buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "Prefill plus decode time.", m, buckets=VLLM_REQUEST_BUCKETS, registry=r)

    def init_model(self, model: str) -> None:
        for reason in FINISHED_REASONS:
            self.success.labels(model_name=model, finished_reason=reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_queries,
                       self.prefix_hits, self.request_prompt_tokens,
                       self.request_generation_tokens, self.ttft, self.itl, self.e2e,
                       self.queue_time, self.prefill_time, self.decode_time, self.inference_time):
            metric.labels(model_name=model)
