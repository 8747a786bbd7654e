"""docs/METRICS.md against the ingress's real registry (prometheus-client, as /metrics renders it):
claims no other test would catch if they stopped being true.

- "The names, types and labels below are a contract": every row of both tables is exported with
  that type and those labels, and nothing else is exported;
- the per-worker gauges are the hub's latest report of every worker (each gauge's value), and a
  worker that left the cluster disappears from them; `kvmesh_replicas{deployment="KVWorker"}`
  counts the workers reporting;
- "Histograms use vLLM's buckets" (vllm/v1/metrics/loggers.py).
"""

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cluster import process_metrics
from kvmesh.cluster.metrics import IngressMetrics
from kvmesh.protocol import WorkerLoad

DOC = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"
MODEL = "tiny"


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, sorted labels) of every row of METRICS.md's tables."""
    rows = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, line  # name | type | labels | meaning
        labels = tuple(sorted(re.findall(r"`([^`]+)`", cells[2])))
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = (cells[1], labels)
    return rows


def ingress_metrics() -> IngressMetrics:
    metrics = IngressMetrics()
    metrics.init_model(MODEL)
    process_metrics.register(metrics.registry)  # as the ingress does (cluster/ingress.py)
    return metrics


def families(loads: dict, stats: dict, metrics: IngressMetrics | None = None) -> dict:
    """A scrape: /metrics renders the hub's latest loads and counters (cluster/ingress.py)."""
    text = (metrics or ingress_metrics()).render(loads, stats).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def loads_of(*worker_ids):
    return {w: WorkerLoad(w, running=2 + i, waiting=5 + i, kv_free_blocks=25 + i, kv_total_blocks=100)
            for i, w in enumerate(worker_ids)}


def stats_of(*worker_ids):
    return {w: {"requests": 10 + i, "preemptions": 3 + i, "prompt_tokens": 200, "cached_tokens": 50 + i}
            for i, w in enumerate(worker_ids)}


def test_every_documented_metric_is_exported_with_its_type_and_labels_and_nothing_else():
    rows = documented()
    assert len(rows) >= 35, sorted(rows)  # both tables were read
    exported, created = {}, set()
    for family in families(loads_of("w1"), stats_of("w1")).values():
        if family.name.endswith("_created"):  # prometheus-client's creation time of a series
            created.add(family.name[:-len("_created")])
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = set().union(*(s.labels for s in family.samples)) - {"le"}
        exported[name] = (family.type, tuple(sorted(labels)))
    assert exported == rows
    # ... of every documented counter and histogram the ingress observes itself: all of them but
    # vllm:num_preemptions_total, read from the workers' reports (METRICS.md)
    assert {n if n in rows else n + "_total" for n in created} == {
        n for n, (kind, _) in rows.items() if kind in ("counter", "histogram")} - {"vllm:num_preemptions_total"}


def per_worker(found: dict, name: str, label: str = "worker") -> dict:
    return {s.labels[label]: s.value for s in found[name].samples}


def test_the_worker_gauges_are_each_worker_s_last_report_and_a_worker_that_left_disappears():
    metrics = ingress_metrics()
    found = families(loads_of("w1", "w2"), stats_of("w1", "w2", "w3"), metrics)  # w3: no load yet
    assert per_worker(found, "kvmesh_queue_depth") == {"w1": 5, "w2": 6}
    assert per_worker(found, "kvmesh_running_requests") == {"w1": 2, "w2": 3}
    assert per_worker(found, "kvmesh_kv_free_blocks") == {"w1": 25, "w2": 26}
    assert per_worker(found, "kvmesh_kv_usage_ratio") == {"w1": 0.75, "w2": 0.74}  # 1 - free / total
    assert per_worker(found, "kvmesh_prefix_hit_rate") == {"w1": 0.25, "w2": 0.255, "w3": 0.26}
    assert per_worker(found, "kvmesh_worker_requests") == {"w1": 10, "w2": 11, "w3": 12}
    assert per_worker(found, "kvmesh_worker_preemptions") == {"w1": 3, "w2": 4, "w3": 5}
    assert per_worker(found, "kvmesh_replicas", "deployment") == {"KVWorker": 3}
    assert per_worker(found, "vllm:num_requests_waiting", "engine") == {"w1": 5, "w2": 6}
    # w2 left: the hub no longer reports it, so the next scrape has no series that names it
    found = families(loads_of("w1"), stats_of("w1", "w3"), metrics)
    for family in found.values():
        for sample in family.samples:
            assert "w2" not in (sample.labels.get("worker"), sample.labels.get("engine")), sample
    assert per_worker(found, "kvmesh_replicas", "deployment") == {"KVWorker": 2}


# vLLM's buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger), copied from vLLM, not from kvmesh
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0]
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def one_two_five(up_to: int) -> list[float]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to `up_to` (its max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > up_to:
                return out
            out.append(float(m * scale))
        scale *= 10


def test_the_vllm_histograms_use_vllm_s_buckets():
    found = families({}, {})
    expected = {"vllm:time_to_first_token_seconds": VLLM_TTFT,
                "vllm:inter_token_latency_seconds": VLLM_ITL,
                **{name: VLLM_REQUEST_LATENCY for name in (
                    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                    "vllm:request_inference_time_seconds")},
                # vLLM's 1-2-5 series, up to 100,000 tokens (vLLM stops at the max_model_len)
                "vllm:request_prompt_tokens": one_two_five(100_000),
                "vllm:request_generation_tokens": one_two_five(100_000)}
    histograms = {name for name, f in found.items() if name.startswith("vllm:") and f.type == "histogram"}
    assert histograms == set(expected)
    for name, buckets in expected.items():
        bounds = [float(s.labels["le"]) for s in found[name].samples if s.name == name + "_bucket"]
        assert bounds == buckets + [float("inf")], name
