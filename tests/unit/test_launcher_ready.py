"""What `kvmesh serve` says when its wait for the worker replicas ends before all reported
(cluster/launcher.py ready_notes), and the bound of that wait that docs/DEPLOY.md states. The wait
itself runs against a real KV event hub in tests/integration/test_doc_claims_ray_live.py."""

import inspect
import re
from pathlib import Path

from kvmesh.cluster import launcher
from kvmesh.cluster.status import cluster_health
from kvmesh.protocol import WorkerLoad
from kvmesh.serve_config import parse_config

ROOT = Path(__file__).resolve().parents[2]


def _health(*healthy: bool, scales_to_zero: bool = False):
    loads = {f"w{i}": WorkerLoad(f"w{i}", healthy=h) for i, h in enumerate(healthy)}
    return cluster_health(loads, scales_to_zero)


def test_no_worker_reported_says_health_answers_503_until_one_does():
    cfg = parse_config({"replicas": {"num_replicas": 2}})
    assert launcher.ready_notes(cfg, _health()) == [
        "kvmesh serve: no worker has reported to the KV event hub yet (no_workers); /health answers 503 "
        "until one does"]
    assert "(kv_event_hub_unavailable)" in launcher.ready_notes(cfg, cluster_health(None, False))[0]


def test_some_of_the_replicas_reported_says_how_many_of_how_many():
    cfg = parse_config({"replicas": {"num_replicas": 3}})
    assert launcher.ready_notes(cfg, _health(True, False, True)) == [
        "kvmesh serve: 2 of 3 worker replicas have reported to the KV event hub so far"]


def test_all_reported_says_nothing_more():
    cfg = parse_config({"replicas": {"num_replicas": 2}})
    assert launcher.ready_notes(cfg, _health(True, True)) == []


def test_under_autoscaling_the_count_is_not_reported():
    cfg = parse_config({"autoscaling": {"enabled": True, "min_replicas": 2, "max_replicas": 4}})
    assert launcher.initial_workers(cfg) == 2
    assert launcher.ready_notes(cfg, _health(True)) == []
    zero = parse_config({"autoscaling": {"enabled": True, "min_replicas": 0, "max_replicas": 4}})
    assert launcher.initial_workers(zero) == 0
    assert launcher.ready_notes(zero, _health(scales_to_zero=True)) == []  # scaled to zero: serving


def test_the_wait_is_bounded_as_deploy_md_says():
    default = inspect.signature(launcher.wait_for_workers).parameters["timeout_s"].default
    text = " ".join((ROOT / "docs" / "DEPLOY.md").read_text().split())
    stated = re.search(r"it waits up to (\d+) s for them, then says how many reported", text)
    assert stated and float(stated.group(1)) == default == 60.0
    assert "wait_for_workers(cfg)" in inspect.getsource(launcher.serve_forever)  # the default bound
