"""`kvmesh serve` starts its local Ray again when Ray's node timed out registering with its GCS
(Ray waits a fixed 30 s; a loaded 2-core machine starting two clusters ran out once in CI):
cluster/launcher.py init_local_ray kills the failed attempt's processes by pid, then starts Ray
again; any other failure is raised as it was, with the attempt's processes stopped too.

The timeout is injected where Ray raises it: the first call of ray._private.services.get_node
(which Ray's node polls until its raylet is registered) raises Ray's own exception, so the first
attempt really started its GCS, raylet and reaper before failing. The driver is a process of its
own (a process can ray.init only once); Ray's token auth is off and everything binds 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kvmesh.cluster.local import loopback_ray_env

pytestmark = [pytest.mark.slow, pytest.mark.starts_ray]

DRIVER = """
import io, json, sys
import psutil, ray
import ray._private.services as services
from kvmesh.cluster import launcher
from kvmesh.serve_config import parse_config

real, first_attempt = services.get_node, []

def get_node(*args, **kwargs):
    if not first_attempt:
        first_attempt.extend(p.pid for p in psutil.Process().children(recursive=True))
        raise Exception(sys.argv[1])
    return real(*args, **kwargs)

services.get_node = get_node
out = io.StringIO()
try:
    gcs = launcher.start_ray(parse_config({"server": {"host": "127.0.0.1"}}), None, out=out)
except Exception as e:
    alive = [pid for pid in first_attempt
             if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    print(json.dumps({"raised": str(e), "first": first_attempt, "alive": alive}), flush=True)
    sys.exit(0)
answer = ray.get(ray.remote(num_cpus=0)(lambda: 41 + 1).remote(), timeout=120)
alive = [pid for pid in first_attempt
         if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
print(json.dumps({"gcs": gcs, "answer": answer, "first": first_attempt, "alive": alive,
                  "out": out.getvalue()}), flush=True)
ray.shutdown()
"""

RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of the "
               "raylet failed to startup or the GCS has become overloaded.")


def drive(message: str) -> dict:
    done = subprocess.run([sys.executable, "-c", DRIVER, message], env=loopback_ray_env(),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_node_that_timed_out_is_stopped_and_ray_started_again():
    seen = drive(RAY_TIMEOUT)
    assert seen["answer"] == 42  # the second attempt's Ray runs tasks
    assert seen["gcs"].startswith("127.0.0.1:")
    # the first attempt had started processes (GCS, raylet, reaper), and none of them is left
    assert len(seen["first"]) >= 2, seen
    assert seen["alive"] == [], seen
    assert "starting Ray again (attempt 2 of 2)" in seen["out"]
    # the launcher counts the attempt's processes when it fails: those the test saw at the first
    # poll, or more (the raylet can start agents in between: 5 seen, 7 stopped, once in CI)
    stopped = re.search(r"stopped its (\d+) processes", seen["out"])
    assert stopped and int(stopped.group(1)) >= len(seen["first"]), seen["out"]


def test_any_other_failure_is_raised_as_it_was_and_leaves_no_process():
    seen = drive("the GCS refused this node (another failure)")
    assert seen["raised"] == "the GCS refused this node (another failure)"
    assert len(seen["first"]) >= 2, seen
    assert seen["alive"] == [], seen  # without the cleanup Ray's agents outlived the driver
