"""`kvmesh serve` survives Serve's controller killing its first proxy before it was ready.

Serve's controller gives a new proxy 5 s (RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S) to answer its
ready check, then kills it (`ray.kill`) and starts another; serve.start waits on the first proxy
only and raised the killed one's ActorDiedError, failing `kvmesh serve --address` once in CI on a
busy machine while Serve went on. cluster/launcher.py start_serve starts Serve again (connecting
to the controller just made) and wait_for_proxies waits for the proxy that replaced it.

The kill is injected where the controller does it: right after serve.start made the controller
and its proxies, the driver kills the proxies with `ray.kill(..., no_restart=True)`, as the
controller's proxy state does to one that missed its ready check. The driver is a process of its
own (a process can ray.init only once); everything binds 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh.cluster.local import free_port, loopback_ray_env

pytestmark = [pytest.mark.slow, pytest.mark.starts_ray]

DRIVER = """
import io, json, sys, urllib.request
import ray
from ray.serve._private import api as serve_api
from kvmesh.cluster import launcher
from kvmesh.serve_config import parse_config

real, killed, not_ready = serve_api._create_controller_and_proxy_refs, [], []

def create(*args, **kwargs):
    controller, refs = real(*args, **kwargs)
    if not killed:  # what the controller does to a proxy that missed its ready check
        for handle in ray.get(controller.get_proxies.remote()).values():
            ray.kill(handle, no_restart=True)
            killed.append(1)
        try:  # no proxy ready yet: the wait's error when its time runs out
            launcher.wait_for_proxies(timeout_s=0)
        except launcher.DeployError as e:
            not_ready.append(str(e))
    return controller, refs

serve_api._create_controller_and_proxy_refs = create
http_port, grpc_port = int(sys.argv[1]), int(sys.argv[2])
cfg = parse_config({"model": "random:tiny-llama", "engine": {"device": "cpu"},
                    "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1},
                    "server": {"host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port}})
out = io.StringIO()
launcher.start_ray(cfg, None, out=out)
try:
    endpoints = launcher.deploy(cfg, out)
    health = launcher.wait_for_workers(cfg)
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=30) as resp:
        answer = resp.status, json.loads(resp.read())
    print(json.dumps({"killed": len(killed), "not_ready": not_ready, "endpoints": endpoints,
                      "health": answer, "out": out.getvalue()}), flush=True)
finally:
    launcher.shutdown(cfg, own_ray=True)
"""


def test_serve_is_started_again_when_its_first_proxy_was_killed_before_it_was_ready():
    http_port, grpc_port = free_port(), free_port()
    done = subprocess.run([sys.executable, "-c", DRIVER, str(http_port), str(grpc_port)],
                          env=loopback_ray_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["killed"] == 1, seen  # one node, one proxy: killed before it was ready
    assert "Serve's proxy was stopped before it was ready" in seen["out"], seen["out"]
    assert "attempt 2 of 3" in seen["out"], seen["out"]
    assert "Serve gives it 5 s" in seen["out"], seen["out"]  # Ray's default grace, the variable unset
    # before any proxy was ready, the wait ran out naming each proxy's status
    assert len(seen["not_ready"]) == 1 and seen["not_ready"][0].startswith(
        "Serve's proxy was not ready within 0 s: {"), seen["not_ready"]
    assert "'STARTING'" in seen["not_ready"][0] or "'UNHEALTHY'" in seen["not_ready"][0], seen
    # the proxy that replaced it serves the app
    assert seen["health"] == [200, {"status": "ok", "workers": 1}], seen
    assert seen["endpoints"]["http"] == f"http://127.0.0.1:{http_port}/v1"
