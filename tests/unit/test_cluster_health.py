"""What /health and gRPC Health answer from the workers' loads (cluster/status.py cluster_health)."""

from kvmesh.cluster.status import cluster_health
from kvmesh.protocol import WorkerLoad


def test_healthy_workers_are_ok_and_counted():
    loads = {"a": WorkerLoad("a"), "b": WorkerLoad("b", healthy=False)}
    for scales_to_zero in (False, True):
        health = cluster_health(loads, scales_to_zero)
        assert (health.http_status, health.body()) == (200, {"status": "ok", "workers": 1})


def test_no_worker_at_all_is_scaled_to_zero_only_where_autoscaling_goes_to_zero():
    at_zero = cluster_health({}, scales_to_zero=True)
    assert (at_zero.http_status, at_zero.body(), at_zero.serving) == (
        200, {"status": "scaled_to_zero", "workers": 0}, True)
    missing = cluster_health({}, scales_to_zero=False)
    assert (missing.http_status, missing.body(), missing.serving) == (
        503, {"status": "no_workers", "workers": 0}, False)


def test_workers_that_all_failed_are_unhealthy_even_when_scaling_to_zero():
    loads = {"a": WorkerLoad("a", healthy=False)}
    for scales_to_zero in (False, True):
        health = cluster_health(loads, scales_to_zero)
        assert (health.http_status, health.body()) == (503, {"status": "no_workers", "workers": 0})
