"""deploy/grafana/kvmesh.json: loads as a Grafana dashboard, and every query names metrics that exist.

Metric names come from two places:
- CONTRACT_METRICS below: the metrics the cluster promises to export (the contract of issue 6);
- `kvmesh.cluster.metrics`, the module that defines them, once it exists: the test then reads the
  prometheus_client collectors it defines, so a renamed metric breaks this test, not a dashboard.
"""

import importlib
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvmesh.json"

# What the ingress exports on /metrics (docs/METRICS.md describes them), by (type, labels).
CONTRACT_KINDS = {
    ("counter", ("model", "status")): ["kvmesh_requests_total"],
    ("histogram", ("model",)): ["kvmesh_request_ttft_seconds", "kvmesh_request_tpot_seconds",
                                "kvmesh_request_e2e_seconds"],
    ("counter", ("model",)): ["kvmesh_prompt_tokens_total", "kvmesh_generation_tokens_total",
                              "kvmesh_cached_prompt_tokens_total"],
    ("gauge", ("worker",)): ["kvmesh_queue_depth", "kvmesh_running_requests", "kvmesh_kv_usage_ratio",
                             "kvmesh_prefix_hit_rate"],
    ("gauge", ("deployment",)): ["kvmesh_replicas"],
    # vLLM's names and labels, exported too (docs/METRICS.md): the dashboard reads either
    ("counter", ("model_name", "finished_reason")): ["vllm:request_success_total"],
    ("counter", ("model_name",)): ["vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                                   "vllm:prefix_cache_hits_total"],
    ("histogram", ("model_name",)): ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                                     "vllm:e2e_request_latency_seconds"],
    ("gauge", ("model_name", "engine")): ["vllm:num_requests_waiting", "vllm:num_requests_running",
                                          "vllm:kv_cache_usage_perc"],
}
# name -> (type, labels)
CONTRACT_METRICS = {name: kind for kind, names in CONTRACT_KINDS.items() for name in names}
# kvmesh metric -> the vLLM metric a panel falls back to on a server that exports only vLLM's names
VLLM_EQUIVALENT = {
    "kvmesh_generation_tokens_total": "vllm:generation_tokens_total",
    "kvmesh_prompt_tokens_total": "vllm:prompt_tokens_total",
    "kvmesh_cached_prompt_tokens_total": "vllm:prefix_cache_hits_total",
    "kvmesh_request_ttft_seconds": "vllm:time_to_first_token_seconds",
    "kvmesh_request_tpot_seconds": "vllm:inter_token_latency_seconds",
    "kvmesh_request_e2e_seconds": "vllm:e2e_request_latency_seconds",
    "kvmesh_queue_depth": "vllm:num_requests_waiting",
    "kvmesh_running_requests": "vllm:num_requests_running",
    "kvmesh_kv_usage_ratio": "vllm:kv_cache_usage_perc",
}
# What the dashboard must show, as the metrics that carry it.
REQUIRED_VIEWS = {
    "TTFT": "kvmesh_request_ttft_seconds",
    "TPOT": "kvmesh_request_tpot_seconds",
    "throughput": "kvmesh_generation_tokens_total",
    "queue depth": "kvmesh_queue_depth",
    "KV usage": "kvmesh_kv_usage_ratio",
    "prefix hit rate": "kvmesh_prefix_hit_rate",
    "replicas per deployment": "kvmesh_replicas",
}
SERIES_SUFFIXES = ("_bucket", "_sum", "_count", "_created")
PROMQL_WORDS = {
    "sum", "by", "without", "rate", "irate", "increase", "histogram_quantile", "clamp_min", "clamp_max",
    "avg", "max", "min", "count", "le", "label_values", "on", "ignoring", "group_left", "topk", "bottomk",
    "or",
}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = []
    for panel in _all_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} target {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            found.append((f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query))
    return found


def _all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for panel in panels:
        out.append(panel)
        out += _all_panels(panel.get("panels", []))
    return out


def metric_names(promql: str) -> set[str]:
    """Series names a PromQL expression selects, as base metric names (histogram/counter suffixes off)."""
    without_labels = re.sub(r"\{[^}]*\}", "", promql)
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_labels)
    without_strings = re.sub(r'"[^"]*"', "", without_ranges)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", without_strings))
    # identifiers used as labels in by(...) clauses and label_values(metric, label)
    labels = set(re.findall(r"(?:by|without)\s*\(([^)]*)\)", without_strings))
    label_words = {w.strip() for group in labels for w in group.split(",")}
    label_words |= set(re.findall(r"label_values\([^,]+,\s*([A-Za-z_]\w*)\)", without_strings))
    names = {w for w in words - PROMQL_WORDS - label_words if not re.fullmatch(r"e\d*|[0-9.]+", w)}
    return {_base(name) for name in names}


def _base(name: str) -> str:
    for suffix in SERIES_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_dashboard_is_grafana_json_with_unique_ids_and_a_datasource_variable():
    dashboard = load_dashboard()
    assert dashboard["title"] == "kvmesh" and dashboard["uid"] == "kvmesh-overview"
    assert isinstance(dashboard["schemaVersion"], int)
    panels = _all_panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert {"type", "title", "gridPos"} <= set(panel), panel.get("title")
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], f"panel {panel['title']!r} has no query"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    [datasource] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert (datasource["name"], datasource["query"]) == ("datasource", "prometheus")


def test_panels_do_not_overlap():
    occupied = {}
    for panel in _all_panels(load_dashboard()["panels"]):
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in occupied, f"{panel['title']!r} overlaps {occupied[(x, y)]!r}"
                occupied[(x, y)] = panel["title"]


def test_metric_name_parser():
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(kvmesh_request_ttft_seconds_bucket'
                        '{model=~"$model"}[$__rate_interval])))') == {"kvmesh_request_ttft_seconds"}
    assert metric_names("sum by (deployment) (kvmesh_replicas)") == {"kvmesh_replicas"}
    assert metric_names("label_values(kvmesh_requests_total, model)") == {"kvmesh_requests_total"}
    assert metric_names("a_total / clamp_min(b_total, 1e-9)") == {"a_total", "b_total"}


def test_every_query_names_only_contract_metrics():
    unknown = {(where, name) for where, expr in queries(load_dashboard()) for name in metric_names(expr)
               if name not in CONTRACT_METRICS}
    assert unknown == set()


def test_dashboard_shows_every_required_view():
    used = {name for _, expr in queries(load_dashboard()) for name in metric_names(expr)}
    missing = {view: metric for view, metric in REQUIRED_VIEWS.items() if metric not in used}
    assert missing == {}


def test_histograms_are_queried_through_buckets_and_counters_through_rate():
    for where, expr in queries(load_dashboard()):
        for name, (kind, _) in CONTRACT_METRICS.items():
            if kind == "histogram" and name in expr:
                assert f"{name}_bucket" in expr and "histogram_quantile" in expr, where
            if kind == "counter" and name in expr and not where.startswith("variable"):
                assert re.search(rf"rate\({name}\{{", expr), where


def test_grouping_labels_are_labels_the_metric_has():
    for where, expr in queries(load_dashboard()):
        names = metric_names(expr)
        labels = set().union(*(CONTRACT_METRICS[n][1] for n in names)) | {"le"}
        for group in re.findall(r"by \(([^)]*)\)", expr):
            assert {w.strip() for w in group.split(",")} <= labels, where
        for selector in re.findall(r"\{([^}]*)\}", expr):
            if selector.startswith("{"):  # legend templates such as {{worker}} are not selectors
                continue
            used = {m.split("=")[0].rstrip("=~!") for m in selector.split(",") if m}
            assert used <= labels, (where, used)


def _exported_by_cluster_code() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, labels) of every metric the cluster's metrics module registers."""
    try:
        module = importlib.import_module("kvmesh.cluster.metrics")
    except ModuleNotFoundError as error:
        if error.name not in ("kvmesh.cluster.metrics", "kvmesh.cluster"):
            raise
        pytest.skip("kvmesh.cluster.metrics is not there yet: the dashboard is checked against "
                    "CONTRACT_METRICS in this file only")
    from prometheus_client import CollectorRegistry

    # The ingress keeps its metrics in its own registry (IngressMetrics().registry); collecting it
    # yields every family, the scrape-time gauges included, even before any sample exists.
    registries = [value for value in vars(module).values() if isinstance(value, CollectorRegistry)]
    registries += [module.IngressMetrics().registry] if hasattr(module, "IngressMetrics") else []
    assert registries, "kvmesh.cluster.metrics has no CollectorRegistry and no IngressMetrics"
    exported = {}
    for registry in registries:
        for collector in list(registry._collector_to_names):
            for family in collector.collect():
                name = family.name + ("_total" if family.type == "counter" else "")
                labels = tuple(getattr(collector, "_labelnames", None) or getattr(family, "_labelnames", ()))
                exported[name] = (family.type, labels)
    return exported


def test_every_dashboard_metric_is_exported_by_the_cluster_code():
    exported = _exported_by_cluster_code()
    used = {name for _, expr in queries(load_dashboard()) for name in metric_names(expr)}
    assert used - set(exported) == set()
    for name in used:
        assert exported[name][0] == CONTRACT_METRICS[name][0], name


def test_the_cluster_code_exports_the_contract_metrics_with_their_labels():
    exported = _exported_by_cluster_code()
    assert {name: exported.get(name) for name in CONTRACT_METRICS} == CONTRACT_METRICS


def test_every_view_works_on_vllm_names_too():
    """A panel of a kvmesh metric that vLLM also exports reads the vLLM one when the kvmesh one is
    absent (`kvmesh... or vllm:...`), and the variables come from vLLM's names, which kvmesh
    exports as well: the dashboard works against kvmesh and against a vLLM server."""
    for where, expr in queries(load_dashboard()):
        names = metric_names(expr)
        if where.startswith("variable"):
            assert all(n.startswith("vllm:") for n in names), where
            continue
        for name in names & set(VLLM_EQUIVALENT):
            assert VLLM_EQUIVALENT[name] in names and " or " in expr, where
