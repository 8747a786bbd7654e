"""kvmesh on Ray's fake multi-node cluster (deploy/local-fake.yaml), the way DEPLOY.md runs it:

  RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=deploy/local-fake.yaml
  kvmesh serve deploy/local-fake-serve.yaml --address ...
  ... requests ...
  ray stop

Worker replicas need the `kvmesh_worker` resource, which only fake worker nodes offer, so the
autoscaler adds a node for the first replica and another when load makes Serve add a second one.

`ray stop` stops every Ray process it can see, so the whole cluster runs inside a PID namespace
of its own (unshare): there `ray stop` sees this cluster only, never another Ray on the machine.
Everything listens on 127.0.0.1.
"""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvmesh.cluster.local import free_port

pytestmark = [pytest.mark.slow, pytest.mark.starts_ray]

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "deploy" / "local-fake.yaml"
SERVE_YAML = REPO / "deploy" / "local-fake-serve.yaml"
MODEL = "random:tiny-llama"
# The namespace's PID 1: reaps orphans (Ray daemonizes) so `ray stop` never waits on zombies.
REAPER = ("import os, time\n"
          "while True:\n"
          "    try:\n"
          "        os.wait()\n"
          "    except ChildProcessError:\n"
          "        time.sleep(0.2)\n")

if importlib.util.find_spec("kvmesh.cluster.app") is None:
    pytest.skip("kvmesh.cluster.app is missing: `kvmesh serve` cannot deploy yet", allow_module_level=True)


def wait_for(what: str, check, timeout_s: float, interval_s: float = 0.5, on_timeout=lambda: ""):
    """Poll `check()` (another process's state: there is no event to await) until truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{on_timeout()}")


class PidNamespace:
    """A PID namespace (with its own /proc) for the cluster; commands run in it through nsenter."""

    def __init__(self):
        if shutil.which("unshare") is None or shutil.which("nsenter") is None:
            pytest.skip("unshare/nsenter (util-linux) missing: cannot isolate `ray stop` from other Ray processes")
        self.holder = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c", REAPER],
            start_new_session=True, stderr=subprocess.PIPE)
        self.init_pid = wait_for("the namespace's init process", self._init_pid, 10, 0.05,
                                 on_timeout=lambda: self.holder.stderr.read1().decode() if self.holder.poll() else "")

    def _init_pid(self):
        if self.holder.poll() is not None:
            pytest.skip(f"cannot create a PID namespace here ({self.holder.stderr.read().decode().strip()}): "
                        "`ray stop` would stop every Ray process on this machine")
        children = Path(f"/proc/{self.holder.pid}/task/{self.holder.pid}/children").read_text().split()
        return int(children[0]) if children else None

    def command(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--target={self.init_pid}", "--pid", "--mount", "--", *argv]

    @staticmethod
    def child_of(nsenter_pid: int) -> int:
        """The process nsenter forked into the namespace (signals go to it, not to nsenter)."""
        return int(Path(f"/proc/{nsenter_pid}/task/{nsenter_pid}/children").read_text().split()[0])

    def processes(self) -> list[str]:
        """Command lines of the processes in the namespace other than its init."""
        inode = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.init_pid:
                continue
            try:
                if os.readlink(entry / "ns" / "pid") == inode:
                    found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
            except OSError:  # exited meanwhile
                pass
        return found

    def close(self):
        # Killing the namespace's init makes the kernel kill everything left in it.
        self.holder.send_signal(signal.SIGKILL)
        self.holder.wait(timeout=30)


@pytest.fixture
def cluster(tmp_path):
    namespace = PidNamespace()
    ports = {name: free_port() for name in ("gcs", "dashboard", "client", "http", "agent_grpc", "agent_http")}
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    config["provider"]["gcs_address"] = f"127.0.0.1:{ports['gcs']}"
    cluster_yaml = tmp_path / "local-fake.yaml"
    cluster_yaml.write_text(yaml.safe_dump(config))
    # Ray's socket paths must stay under 107 bytes: a short temp dir, not pytest's tmp_path.
    ray_temp = tempfile.mkdtemp(prefix="kvf")
    env = dict(os.environ, RAY_FAKE_CLUSTER="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", AUTOSCALER_UPDATE_INTERVAL_S="1",
               KVMESH_OBJECT_STORE_BYTES=str(128 << 20))
    ray = str(Path(sys.executable).with_name("ray"))
    state = {"namespace": namespace, "ports": ports, "env": env, "ray": ray, "tmp": tmp_path, "temp_dir": ray_temp}
    try:
        start = subprocess.run(namespace.command([
            ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={ports['gcs']}", "--num-cpus=2",
            f"--autoscaling-config={cluster_yaml}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={ports['dashboard']}", f"--ray-client-server-port={ports['client']}",
            f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
            f"--dashboard-agent-listen-port={ports['agent_http']}",
            f"--object-store-memory={128 << 20}", f"--temp-dir={ray_temp}"]),
            env=env, capture_output=True, text=True, timeout=120)
        assert start.returncode == 0, start.stdout + start.stderr
        yield state
    finally:
        namespace.close()
        shutil.rmtree(ray_temp, ignore_errors=True)


def alive_nodes(dashboard_port: int) -> list[dict]:
    url = f"http://127.0.0.1:{dashboard_port}/api/v0/nodes?detail=true&limit=100"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            nodes = json.load(response)["data"]["result"]["result"]
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return []
    return [n for n in nodes if n["state"] == "ALIVE"]


def worker_nodes(dashboard_port: int) -> list[dict]:
    return [n for n in alive_nodes(dashboard_port) if "kvmesh_worker" in n.get("resources_total", {})]


def post(url: str, body: dict, timeout: float = 60) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.status == 200
        return json.load(response)


def test_kvmesh_on_fake_multinode_cluster_scales_nodes_with_replicas(cluster):
    namespace, ports, env = cluster["namespace"], cluster["ports"], cluster["env"]
    dashboard, base = ports["dashboard"], f"http://127.0.0.1:{ports['http']}"

    # The head alone: it lacks kvmesh_worker, so no replica can run on it.
    head = wait_for("the head node", lambda: alive_nodes(dashboard), 60)
    assert len(head) == 1 and "kvmesh_worker" not in head[0]["resources_total"]

    log = (cluster["tmp"] / "kvmesh-serve.log").open("w")
    serve = subprocess.Popen(namespace.command([
        sys.executable, "-m", "kvmesh.cli", "serve", str(SERVE_YAML),
        f"--address=127.0.0.1:{ports['gcs']}", f"--http-port={ports['http']}"]),
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    serve_log = lambda: (cluster["tmp"] / "kvmesh-serve.log").read_text()[-4000:]

    def ready():
        assert serve.poll() is None, f"kvmesh serve exited with {serve.returncode}:\n{serve_log()}"
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    # The first replica made the autoscaler add one worker node.
    wait_for("kvmesh to answer /v1/models with a worker node up",
             lambda: ready() and worker_nodes(dashboard), 240, on_timeout=serve_log)
    assert len(worker_nodes(dashboard)) == 1

    completion = post(f"{base}/v1/completions",
                      {"model": MODEL, "prompt": "The fake cluster says", "max_tokens": 8, "ignore_eos": True},
                      timeout=180)
    assert completion["usage"]["completion_tokens"] == 8
    assert completion["choices"][0]["finish_reason"] == "length"

    # Load above target_ongoing_requests=1: Serve adds a replica, which needs a second worker node.
    stop_load = threading.Event()
    errors = []

    def keep_busy():
        while not stop_load.is_set():
            try:
                post(f"{base}/v1/completions",
                     {"model": MODEL, "prompt": "load", "max_tokens": 256, "ignore_eos": True}, timeout=120)
            except Exception as error:  # reported below: a failed request fails the test
                errors.append(repr(error))
                return

    clients = [threading.Thread(target=keep_busy, daemon=True) for _ in range(4)]
    for client in clients:
        client.start()
    try:
        wait_for("a second worker node for the second replica", lambda: len(worker_nodes(dashboard)) == 2,
                 180, on_timeout=serve_log)
        wait_for("two running worker replicas", lambda: _running_workers(base) == 2, 120, on_timeout=serve_log)
    finally:
        stop_load.set()
        for client in clients:
            client.join(timeout=120)
    assert errors == []

    # `kvmesh status` reads the running cluster through the HTTP API.
    status = subprocess.run([sys.executable, "-m", "kvmesh.cli", "status", f"--url={base}"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert MODEL in status.stdout, status.stdout

    # Stop as DEPLOY.md does: Ctrl-C (here SIGTERM) on kvmesh serve deletes the app, then ray stop
    # (inside the namespace) ends every process of the cluster.
    os.kill(namespace.child_of(serve.pid), signal.SIGTERM)
    assert serve.wait(timeout=60) == 0, serve_log()
    stop = subprocess.run(namespace.command([cluster["ray"], "stop"]), env=env, capture_output=True,
                          text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    wait_for("every cluster process to exit after ray stop", lambda: namespace.processes() == [], 60,
             on_timeout=lambda: "\n".join(namespace.processes()))
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen(f"{base}/v1/models", timeout=5)


def _running_workers(base: str) -> int:
    """Worker replicas the ingress reports in /metrics (kvmesh_replicas{deployment="KVWorker"})."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return 0
    for line in text.splitlines():
        if line.startswith('kvmesh_replicas{deployment="KVWorker"}'):
            return int(float(line.split()[-1]))
    return 0
