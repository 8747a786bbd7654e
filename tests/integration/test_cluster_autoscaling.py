"""Worker autoscaling with a kvmesh policy on the CPU: 1 -> 2 replicas under load, back to 1 idle.

The ongoing_requests policy with a target of 1 request per replica, short delays and window, so
that 4 long requests in flight ask for 2 replicas (max) within seconds and idleness for 1.
"""

import concurrent.futures as cf
import json
import re
import time
import urllib.request

import pytest

from cluster_support import MODEL, config_cluster, cpu_config

pytestmark = pytest.mark.slow


def replicas(cluster) -> float | None:
    """kvmesh_replicas from /metrics; None when the scrape left it out (the KV event hub did not
    answer within its bound: kvmesh_kv_event_hub_up 0, docs/METRICS.md), so callers ask again."""
    with urllib.request.urlopen(cluster.http_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = re.search(r'^kvmesh_replicas\{deployment="KVWorker"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


def wait_for_replicas(cluster, n, timeout_s):
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        seen.append(replicas(cluster))
        if seen[-1] == n:
            return seen
        time.sleep(0.25)
    raise AssertionError(f"no {n} replicas within {timeout_s} s; saw {sorted(set(seen), key=str)}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = cpu_config(autoscaling={
        "enabled": True, "policy": "ongoing_requests", "min_replicas": 1, "max_replicas": 2,
        "target_ongoing_requests": 1, "upscale_delay_s": 1, "downscale_delay_s": 3, "window_s": 2})
    with config_cluster(tmp_path_factory, config) as c:
        yield c


def test_scales_up_under_load_and_down_when_idle(cluster):
    assert replicas(cluster) == 1

    def one(i):
        body = json.dumps({"model": MODEL, "prompt": f"load {i}", "max_tokens": 400,
                           "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(cluster.http_url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status

    stop_at = time.monotonic() + 120
    with cf.ThreadPoolExecutor(4) as ex:
        # keep 4 requests in flight until the second replica reports (or the bound passes)
        pending = {ex.submit(one, i) for i in range(4)}
        statuses, i = [], 4
        while time.monotonic() < stop_at:
            if replicas(cluster) == 2:
                break
            done = {f for f in pending if f.done()}
            for f in done:
                statuses.append(f.result())
                pending.discard(f)
                pending.add(ex.submit(one, i))
                i += 1
            time.sleep(0.25)
        assert replicas(cluster) == 2
        statuses += [f.result() for f in pending]
    assert set(statuses) == {200}
    wait_for_replicas(cluster, 1, timeout_s=90)
