"""Scale to zero and back on the CPU: with autoscaling.min_replicas 0 an idle cluster gives back its
last worker replica; a request arriving then waits at the ingress (Serve's handle queue) while
Serve's cold-start path starts a replica, and is answered; idle again, the count goes back to 0.
And the TTFT a worker reports to the autoscaler counts from the request's arrival at the ingress,
so a request that waited there for a replica slot has that wait inside.

One replica at most, one request at a time on it (max_ongoing_requests 1), short delays.
"""

import concurrent.futures as cf
import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

from kvmesh.cluster.local import LocalCluster, loopback_ray_env
from test_cluster_autoscaling import wait_for_replicas

pytestmark = pytest.mark.slow

MODEL = "random:tiny-llama"
WINDOW_S = 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "scale_to_zero.yaml"
    config.write_text(yaml.safe_dump({
        "model": MODEL,
        "engine": {"device": "cpu"},
        "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1, "max_ongoing_requests": 1},
        "autoscaling": {"enabled": True, "policy": "queue", "min_replicas": 0, "max_replicas": 1,
                        "target_ongoing_requests": 1, "upscale_delay_s": 0, "downscale_delay_s": 1,
                        "downscale_to_zero_delay_s": 2, "window_s": WINDOW_S},
    }))
    with LocalCluster([], config=str(config)) as c:
        yield c


def complete(cluster, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(cluster.http_url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def health(cluster) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(cluster.http_url + "/health", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def grpc_health(cluster) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(cluster.grpc_target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=30).status


def test_grpc_health_is_serving_at_zero_and_with_a_worker(cluster):
    """At zero a request starts a replica, so a probe must keep the endpoint in (as /health's 200
    scaled_to_zero); NOT_SERVING (no worker where autoscaling cannot reach zero, or every worker
    failed) is tested on cluster_health, which both answer from (tests/unit/test_cluster_health.py)."""
    from grpc_health.v1 import health_pb2

    wait_for_replicas(cluster, 0, timeout_s=120)
    deadline = time.monotonic() + 60  # the hub forgets the last worker shortly after Serve stops it
    while health(cluster)[1]["status"] == "ok" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert grpc_health(cluster) == health_pb2.HealthCheckResponse.SERVING
    complete(cluster, "wake up", 2)
    assert grpc_health(cluster) == health_pb2.HealthCheckResponse.SERVING


def test_scales_to_zero_when_idle_and_a_request_brings_a_replica_back(cluster):
    wait_for_replicas(cluster, 0, timeout_s=120)
    # At zero /health answers 200 "scaled_to_zero" (a load balancer that saw 503 would stop sending
    # the request that wakes it); the hub forgets the last worker shortly after Serve stops it.
    deadline = time.monotonic() + 60
    while (answer := health(cluster))[1]["status"] == "ok" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert answer == (200, {"status": "scaled_to_zero", "workers": 0})
    # Zero just before the request goes (nothing else sends one), 1 while it waits. Read after it
    # went, the count can already be 1: Serve's controller raises its target as the request
    # reaches the handle (upscale_delay_s 0), sooner than a scrape of /metrics answers (CI, once).
    wait_for_replicas(cluster, 0, timeout_s=30)
    with cf.ThreadPoolExecutor(1) as ex:
        answer = ex.submit(complete, cluster, "wake up", 8)
        wait_for_replicas(cluster, 1, timeout_s=180)
        assert answer.result(timeout=300)["usage"]["completion_tokens"] == 8
    # Idle again: the replica leaves the KV event hub when Serve shuts it down (KVWorker.__del__),
    # so /health follows Serve within seconds (dropped for silence it took up to ~35 s), and it is
    # never 503 on the way (the stopping engine was once seen unhealthy: no_workers for ~3 s).
    with serve_replica_states(cluster) as states:
        deadline, answers = time.monotonic() + 120, []
        while states() and time.monotonic() < deadline:
            answers.append(health(cluster))
            time.sleep(0.25)
        assert not states(), "Serve did not scale the workers to zero within 120 s"
        gone = time.monotonic()
        while (answer := health(cluster))[1]["status"] != "scaled_to_zero" and time.monotonic() < gone + 30:
            answers.append(answer)
            time.sleep(0.25)
        lag = time.monotonic() - gone
    assert answer == (200, {"status": "scaled_to_zero", "workers": 0})
    assert lag < 5, f"/health said scaled_to_zero {lag:.1f} s after Serve stopped the last replica"
    assert {code for code, _ in answers} == {200}, sorted({json.dumps(a) for _, a in answers})
    wait_for_replicas(cluster, 0, timeout_s=10)  # kvmesh_replicas comes from the same hub loads


REPLICA_STATES = """
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], namespace="serve", logging_level="ERROR")
print("ready", flush=True)
for _ in sys.stdin:
    app = serve.status().applications["kvmesh"]
    print(json.dumps(app.deployments["KVWorker"].replica_states), flush=True)
"""


@contextlib.contextmanager
def serve_replica_states(cluster):
    """A function answering Serve's own count of worker replicas by state ({} at zero), from a
    driver on the cluster: kvmesh_replicas and /health count the workers the hub lists."""
    driver = subprocess.Popen([sys.executable, "-c", REPLICA_STATES, cluster.ray_address], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=loopback_ray_env())
    try:
        assert driver.stdout.readline().strip() == "ready"

        def states() -> dict:
            driver.stdin.write("status\n")
            driver.stdin.flush()
            return {k: v for k, v in json.loads(driver.stdout.readline()).items() if v}
        yield states
    finally:
        driver.stdin.close()
        driver.wait(timeout=60)


STATS = """
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], namespace="serve", logging_level="ERROR")
handle = serve.get_deployment_handle("KVWorker", app_name="kvmesh")
print("ready", flush=True)
for _ in sys.stdin:
    print(json.dumps(handle.record_autoscaling_stats.remote().result()), flush=True)
"""


def test_the_ttft_a_worker_reports_includes_the_wait_at_the_ingress(cluster):
    stats = subprocess.Popen([sys.executable, "-c", STATS, cluster.ray_address], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=loopback_ray_env())
    try:
        assert stats.stdout.readline().strip() == "ready"
        complete(cluster, "warm", 1)  # a replica is up (cold start) before the timed pair
        with cf.ThreadPoolExecutor(2) as ex:
            # 1,800 tokens: seconds on the tiny model even on an idle machine (600 took 0.7 s there)
            long = ex.submit(complete, cluster, "long", 1800)
            time.sleep(0.5)  # the long one holds the replica's only slot
            sent = time.time()
            short = ex.submit(complete, cluster, "short", 1)  # waits at the ingress for the slot
            long.result(timeout=300)
            waited = time.time() - sent
            short.result(timeout=300)
        assert waited > 0.5
        stats.stdin.write("stats\n")
        stats.stdin.flush()
        reported = json.loads(stats.stdout.readline())
        # p90 of the few requests in the window is the largest: the short one's, ingress wait included
        assert reported["kvmesh_ttft_p90_s"] >= waited - 0.25, (reported, waited)
    finally:
        stats.stdin.close()
        stats.wait(timeout=60)
