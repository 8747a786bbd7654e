"""The soak benchmark's verdict (kvmesh/bench/soak.py): growth after warm-up, lost requests, index
bound; and its --mix parsing."""

import pytest

from kvmesh.bench.soak import growth, judge, parse_mix


def _samples(values, key="Ingress[0]_rss_mb"):
    return [{"t": i, key: v, "router_index_blocks": 10, "kv_total_blocks": 100} for i, v in enumerate(values)]


def test_growth_compares_the_last_and_first_fifths_after_warm_up():
    values = [500] * 20 + [100] * 20 + [100] * 60 + [130] * 20  # warm-up spike is ignored
    assert growth(_samples(values), "Ingress[0]_rss_mb", 0.2) == 30
    assert growth(_samples([1, 2, 3]), "Ingress[0]_rss_mb", 0.2) is None


def test_judge_fails_on_a_lost_request_growth_or_an_index_beyond_the_pools():
    flat = _samples([100] * 50)
    assert judge(flat, {"lost": 0}, 50, 0.2)["ok"]
    assert not judge(flat, {"lost": 1}, 50, 0.2)["ok"]
    growing = _samples([100 + i * 3 for i in range(50)])
    verdict = judge(growing, {"lost": 0}, 50, 0.2)
    assert not verdict["ok"] and "memory grew" in verdict["problems"][0]
    big_index = [dict(s, router_index_blocks=1000) for s in flat]
    assert "router index" in judge(big_index, {"lost": 0}, 50, 0.2)["problems"][0]


def test_parse_mix():
    assert parse_mix("whole=1,abort=0.5") == {"whole": 1.0, "abort": 0.5}
    with pytest.raises(ValueError, match="kind=weight"):
        parse_mix("chat=1")


def test_traffic_reads_a_grpc_status_as_the_http_status_the_ingress_answers_for_it():
    """kvmesh.bench.traffic.GRPC_AS_HTTP is cluster/grpc_service.py's mapping read backwards, so a
    gRPC request is retried on what an HTTP one would be (429, 503), and fails on the rest."""
    from kvmesh.bench.traffic import GRPC_AS_HTTP, RETRY_STATUSES
    from kvmesh.cluster.grpc_service import _STATUS

    for http_status, code in _STATUS.items():
        assert GRPC_AS_HTTP[code.name] == http_status
    assert {name for name, status in GRPC_AS_HTTP.items() if status in RETRY_STATUSES} == {
        "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"}


def test_a_grpc_request_needs_the_clusters_grpc_target():
    from kvmesh.bench.traffic import Traffic

    with pytest.raises(ValueError, match="grpc_target"):
        Traffic("http://127.0.0.1:9", "m").one(0, "grpc")
