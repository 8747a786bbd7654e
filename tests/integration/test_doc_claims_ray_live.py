"""Doc claims about the Ray a `kvmesh serve` starts or joins, and the KV event hub it runs there,
checked on a real Ray (what test_doc_claims_deploy.py and test_doc_claims_serving_cluster.py
used to check by replacing ray.init / KVEventHub.options):

- docs/DEPLOY.md: a local `kvmesh serve` starts its Ray without a dashboard; `kvmesh serve
  --address auto` passes the worker hook with the config's server.* settings to what it starts;
- docs/SERVING.md: the KV event hub is a named, detached, 0-CPU actor per app in namespace `serve`;
  after a deployment's Serve shutdown it stays and the next deployment of the app name uses it.

One local Ray for the module, started as `kvmesh serve` starts it: cluster/launcher.py start_ray
in a process of its own (it sets variables in its environment that Ray's processes inherit, and a
process can ray.init only once). Each test's driver is a separate process too. Ray token auth is
off (loopback_ray_env), so nothing is written under ~/.ray; everything binds 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvmesh import serve_config as serving
from kvmesh.cluster.launcher import listener_env
from kvmesh.cluster.local import loopback_ray_env, with_this_source

pytestmark = [pytest.mark.slow, pytest.mark.starts_ray]

REPO = Path(__file__).resolve().parents[2]
DRIVER_TIMEOUT_S = 240  # a driver on a busy 2-core machine: import Ray, connect, start a worker

# The local Ray's own config: every setting listener_env carries differs from deploy/serve.yaml's,
# so a joining job's workers show which config's settings reached them.
HOLDER_SERVER = {"host": "127.0.0.1", "max_header_bytes": 12_345, "header_timeout_s": 7,
                 "stream_idle_timeout_s": 11, "grpc_max_message_bytes": 3 * 1024 * 1024}

# `kvmesh serve`'s start of a local Ray, held until stdin closes.
HOLDER = """
import io, json, sys
import ray
from ray._private.services import get_webui_url_from_internal_kv
from kvmesh.cluster import launcher
from kvmesh.serve_config import parse_config
gcs = launcher.start_ray(parse_config({"server": json.loads(sys.argv[1])}), None, out=io.StringIO())
node = ray._private.worker.global_worker.node
print(json.dumps({"gcs": gcs, "webui_url": node.webui_url,
                  "kv_webui_url": get_webui_url_from_internal_kv()}), flush=True)
sys.stdin.read()
ray.shutdown()
"""

# `kvmesh serve CONFIG --address auto`'s join (RAY_ADDRESS names the module's Ray), then what a
# worker process of that job sees: the listener settings and whether the hook ran in it.
JOINER = """
import io, json, sys
import ray
from kvmesh.cluster import launcher
from kvmesh.serve_config import load_config
cfg = load_config(sys.argv[1])
launcher.start_ray(cfg, "auto", out=io.StringIO())

@ray.remote(num_cpus=0)
def seen(names):
    import os
    from kvmesh.cluster import ray_patches
    return {"env": {name: os.environ.get(name) for name in names}, "hook_ran": ray_patches._applied}

print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                  "worker": ray.get(seen.remote(list(launcher.listener_env(cfg))), timeout=180)}),
      flush=True)
ray.shutdown()
"""

# A local `kvmesh serve`'s start of Ray (no --address) where RAY_ADDRESS names a running one.
LOCAL_STARTER = """
import io, json, sys
import ray
from kvmesh.cluster import launcher
from kvmesh.serve_config import parse_config
gcs = launcher.start_ray(parse_config({"server": {"host": "127.0.0.1"}}), None, out=io.StringIO())
print(json.dumps({"gcs": gcs}), flush=True)
ray.shutdown()
"""

# Creates the app's hub with every CPU of the cluster reserved (a placement group: no worker
# process), calls it, looks it up by name in `serve`, then exits (ending its job).
HUB_CREATOR = """
import json, sys
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from kvmesh.cluster import event_hub
ray.init(address=sys.argv[1], namespace="not-serve", logging_level="WARNING")
cpus = ray.cluster_resources()["CPU"]
every_cpu = placement_group([{"CPU": cpus}])
ray.get(every_cpu.ready(), timeout=120)
hub = event_hub.get_or_create_hub(sys.argv[2])
ray.get(hub.loads.remote(), timeout=120)  # placed and running with no CPU left
found = ray.get_actor(event_hub.hub_name(sys.argv[2]), namespace="serve")
print(json.dumps({"cpus": cpus, "created": hub._actor_id.hex(), "found": found._actor_id.hex()}),
      flush=True)
remove_placement_group(every_cpu)
ray.shutdown()
"""

# After the creator's job ended: the hub by name, still answering; then kvmesh's kill_hub.
HUB_AFTER = """
import json, sys
import ray
from kvmesh.cluster import event_hub
ray.init(address=sys.argv[1], namespace="not-serve", logging_level="WARNING")
try:
    hub = ray.get_actor(event_hub.hub_name(sys.argv[2]), namespace="serve")
    ray.get(hub.loads.remote(), timeout=120)
    alive = hub._actor_id.hex()
except ValueError:
    alive = None
print(json.dumps({"alive": alive, "killed": event_hub.kill_hub(sys.argv[2])}), flush=True)
ray.shutdown()
"""

# Creates the app's response store with every CPU reserved, stores a response, exits (ending its job).
STORE_CREATOR = """
import json, sys
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from kvmesh.cluster import response_store
ray.init(address=sys.argv[1], namespace="not-serve", logging_level="WARNING")
every_cpu = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
ray.get(every_cpu.ready(), timeout=120)
store = response_store.get_or_create_store(sys.argv[2])
ray.get(store.put.remote({"id": "resp_a", "status": "completed", "output": ["answer"]}, ["turn"], "", 10),
        timeout=120)
print(json.dumps({"created": store._actor_id.hex()}), flush=True)
remove_placement_group(every_cpu)
ray.shutdown()
"""

# After the creator's job ended: the store by name, still holding the response; then `kvmesh
# serve`'s shutdown of the app (launcher.shutdown, on a Ray it joined) and a look for the store.
STORE_AFTER = """
import json, sys
import ray
from kvmesh.cluster import launcher, response_store
from kvmesh.serve_config import parse_config
ray.init(address=sys.argv[1], namespace="not-serve", logging_level="WARNING")
store = ray.get_actor(response_store.store_name(sys.argv[2]), namespace="serve")
kept = ray.get(store.get.remote("resp_a", ""), timeout=120)
launcher.shutdown(parse_config({"app_name": sys.argv[2]}), own_ray=False)
try:
    ray.get_actor(response_store.store_name(sys.argv[2]), namespace="serve")
    gone = False
except ValueError:
    gone = True
print(json.dumps({"alive": store._actor_id.hex(), "kept": kept, "gone": gone}), flush=True)
ray.shutdown()
"""

# launcher.wait_for_workers against the app's real hub: with no worker reported, and then with one
# and two workers' loads published into it (what each worker replica does a second or so after Serve
# calls it healthy).
WAIT_FOR_WORKERS = """
import json, sys, time
import ray
from kvmesh.cluster import event_hub, launcher
from kvmesh.protocol import KVSnapshot, WorkerLoad
from kvmesh.serve_config import parse_config
ray.init(address=sys.argv[1], namespace="not-serve", logging_level="WARNING")
cfg = parse_config({"app_name": sys.argv[2], "replicas": {"num_replicas": 2}})
hub = event_hub.get_or_create_hub(sys.argv[2])

def report(worker):
    ray.get(hub.publish_snapshot.remote(KVSnapshot(worker, 0, 0, []), WorkerLoad(worker, timestamp=time.time()),
                                        None), timeout=60)

def wait(timeout_s):
    started = time.monotonic()
    health = launcher.wait_for_workers(cfg, timeout_s=timeout_s)
    return [health.status, health.workers, round(time.monotonic() - started, 2)]

none = wait(1.0)
report("w1")
one = wait(1.0)
report("w2")
two = wait(30.0)
print(json.dumps({"none": none, "one": one, "two": two, "killed": event_hub.kill_hub(sys.argv[2])}), flush=True)
ray.shutdown()
"""

# Deploys the app (launcher.deploy: what `kvmesh serve` and `serve deploy` run) with one CPU worker,
# waits for a worker to report to the hub and for a completion, shuts Serve down (`serve shutdown`),
# looks for the hub, and deploys the same app name again.
REDEPLOY = """
import io, json, sys, time, urllib.request
import ray
from ray import serve
from kvmesh.cluster import event_hub, launcher
from kvmesh.serve_config import parse_config
ray.init(address=sys.argv[1], namespace="not-serve", logging_level="WARNING")
app, port = sys.argv[2], int(sys.argv[3])
cfg = parse_config({"app_name": app, "model": "random:tiny-llama", "engine": {"device": "cpu"},
                    "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1},
                    "server": {"host": "127.0.0.1", "http_port": port, "grpc_port": 0}})

def deployment(before):
    launcher.deploy(cfg, out=io.StringIO())
    deadline = time.monotonic() + 150
    while True:  # a worker this deployment started has reported to the hub
        hub = ray.get_actor(event_hub.hub_name(app), namespace="serve")
        workers = set(ray.get(hub.loads.remote(), timeout=30)[0]) - before
        if workers or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    body = json.dumps({"model": "random:tiny-llama", "prompt": "hello", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        status = response.status
    return {"hub": hub._actor_id.hex(), "workers": sorted(workers), "status": status}

first = deployment(set())
serve.shutdown()
try:
    stayed = ray.get_actor(event_hub.hub_name(app), namespace="serve")._actor_id.hex()
except ValueError:
    stayed = None
second = deployment(set(first["workers"]))
serve.shutdown()
print(json.dumps({"first": first, "stayed": stayed, "second": second, "killed": event_hub.kill_hub(app)}),
      flush=True)
ray.shutdown()
"""


def _env(**extra) -> dict[str, str]:
    env = with_this_source(loopback_ray_env())
    env.pop("RAY_ADDRESS", None)
    return {**env, **extra}


def _driver(script: str, *args: str, timeout_s: float = DRIVER_TIMEOUT_S, **env) -> dict:
    done = subprocess.run([sys.executable, "-c", script, *args], env=_env(**env), capture_output=True,
                          text=True, timeout=timeout_s, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _stop_tree(proc: subprocess.Popen, tree: list[psutil.Process]) -> None:
    """Close the holder's stdin (it shuts its Ray down and exits); then SIGKILL, by pid, whatever
    of the tree it started is still running."""
    try:
        proc.stdin.close()
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
        proc.wait(10)
    gone, alive = psutil.wait_procs(tree, timeout=30)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.fixture(scope="module")
def local_ray():
    """The Ray of a local `kvmesh serve` (start_ray with HOLDER_SERVER), in a process of its own:
    (holder process, what it reported: gcs address and the dashboard URL Ray holds)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(HOLDER_SERVER)], env=_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=REPO)
    tree: list[psutil.Process] = []
    try:
        line = proc.stdout.readline()
        assert line, f"start_ray failed: {proc.stderr.read()[-4000:]}"
        info = json.loads(line)
        tree = psutil.Process(proc.pid).children(recursive=True)
        yield proc, info
        tree = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else tree
    finally:
        _stop_tree(proc, tree)


def _cmdlines(proc: subprocess.Popen) -> list[str]:
    out = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            out.append(" ".join(p.cmdline()))
        except psutil.Error:
            pass
    return out


def test_a_local_kvmesh_serve_starts_its_ray_without_a_dashboard(local_ray):
    """DEPLOY.md: "not on the one-machine kvmesh serve, which starts its Ray without a dashboard"."""
    proc, info = local_ray
    # The URL Ray publishes for its dashboard (GCS key webui:url, what `ray status` and
    # ray.init print): empty, no server to reach; the head's API server runs without its frontend.
    assert info["webui_url"] == "" and info["kv_webui_url"] == "", info
    cmdlines = _cmdlines(proc)
    assert any("gcs_server" in c for c in cmdlines) and any("raylet" in c for c in cmdlines), cmdlines
    heads = [c for c in cmdlines if "ray/dashboard/dashboard.py" in c]
    assert heads and all("--disable-frontend" in c for c in heads), heads


def test_kvmesh_serve_address_passes_the_worker_hook_with_the_server_settings(local_ray):
    """DEPLOY.md: "The head's kvmesh serve --address auto also passes the hook with
    deploy/serve.yaml's server.* settings to the Serve processes it starts"."""
    _, info = local_ray
    serve_yaml = str(REPO / "deploy" / "serve.yaml")
    expected = listener_env(serving.load_config(serve_yaml))
    theirs = listener_env(serving.parse_config({"server": HOLDER_SERVER}))
    assert all(expected[k] != theirs[k] for k in expected), (expected, theirs)  # not vacuous
    joined = _driver(JOINER, serve_yaml, RAY_ADDRESS=info["gcs"])  # "auto" finds it there
    assert joined["gcs"] == info["gcs"]  # joined the running Ray, started none
    # A worker process of the job (as Serve's controller, proxies and replicas are): the hook ran
    # in it (the node's environment names none), with serve.yaml's settings, not the node's.
    assert joined["worker"] == {"env": expected, "hook_ran": True}, joined


def test_a_local_kvmesh_serve_starts_a_ray_of_its_own_where_another_is_named(local_ray):
    """SERVING.md: "Without --address, kvmesh serve starts a Ray of its own on this machine, even
    where RAY_ADDRESS names a running one"."""
    _, info = local_ray
    started = _driver(LOCAL_STARTER, RAY_ADDRESS=info["gcs"])
    assert started["gcs"] != info["gcs"], started


def test_the_hub_is_a_detached_zero_cpu_actor_named_after_the_app_in_the_serve_namespace(local_ray):
    """Intro: "a named, detached Ray actor per app (`kvmesh-kv-events-<app>`, namespace `serve`)";
    "the hub (0 CPUs) stays"."""
    from kvmesh.cluster.event_hub import hub_name

    _, info = local_ray
    assert hub_name("myapp") == "kvmesh-kv-events-myapp"
    created = _driver(HUB_CREATOR, info["gcs"], "myapp")
    assert created["cpus"] >= 1
    # found by its name in `serve` from a driver of another namespace: the same actor
    assert created["found"] == created["created"], created
    # the driver that created it has exited: a non-detached actor would have ended with its job
    after = _driver(HUB_AFTER, info["gcs"], "myapp")
    assert after == {"alive": created["created"], "killed": True}, (created, after)


def test_the_response_store_outlives_its_creators_job_and_kvmesh_serves_shutdown_ends_it(local_ray):
    """SERVING.md: the store of /v1/responses responses is one 0-CPU actor per app
    (`kvmesh-responses-<app>`, namespace `serve`), detached as the hub is, and `kvmesh serve`'s
    shutdown ends it."""
    from kvmesh.cluster.response_store import store_name

    _, info = local_ray
    assert store_name("myapp") == "kvmesh-responses-myapp"
    created = _driver(STORE_CREATOR, info["gcs"], "myapp")
    after = _driver(STORE_AFTER, info["gcs"], "myapp")
    kept = [{"id": "resp_a", "status": "completed", "output": ["answer"]}, ["turn", "answer"]]
    assert after == {"alive": created["created"], "kept": kept, "gone": True}, after


def test_serve_prints_ready_once_the_workers_have_reported_to_the_hub(local_ray):
    """`kvmesh serve` prints its ready line after launcher.wait_for_workers: /health then answers
    ok and counts every replica the deployment starts with. Against the app's real hub: with no
    worker reported it waits out its bound and says no_workers; with one of two it waits on; with
    both it returns at once."""
    _, info = local_ray
    got = _driver(WAIT_FOR_WORKERS, info["gcs"], "waitapp")
    assert got["none"][:2] == ["no_workers", 0] and got["none"][2] >= 1.0, got
    assert got["one"][:2] == ["ok", 1] and got["one"][2] >= 1.0, got  # 1 of 2: waited its bound
    assert got["two"][:2] == ["ok", 2] and got["two"][2] < 5.0, got
    assert got["killed"] is True


def test_after_serve_shutdown_the_hub_stays_and_the_next_deployment_of_the_app_uses_it(local_ray):
    """SERVING.md: "after `serve deploy` + `serve shutdown` the hub (0 CPUs) stays and is reused by
    the next deployment of the same app name": the same actor before, between and after, the second
    deployment's new worker reports into it, and that deployment serves."""
    from kvmesh.cluster.local import free_port

    _, info = local_ray
    got = _driver(REDEPLOY, info["gcs"], "redeployapp", str(free_port()), timeout_s=2 * DRIVER_TIMEOUT_S)
    first, second = got["first"], got["second"]
    assert first["workers"] and first["status"] == 200, got
    assert got["stayed"] == first["hub"], got  # Serve's shutdown left it
    assert second["hub"] == first["hub"], got  # the next deployment found it by name
    assert second["workers"] and not set(second["workers"]) & set(first["workers"]), got  # a new worker
    assert second["status"] == 200 and got["killed"] is True, got
