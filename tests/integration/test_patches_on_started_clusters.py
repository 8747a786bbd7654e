"""The worker hook's patches (cluster/ray_patches.py) on a Ray cluster that `kvmesh serve` did not
start (docs/SERVING.md "What the patches cover"; docs/DEPLOY.md).

A Ray head starts on 127.0.0.1 with exactly the environment of deploy/aws.yaml's head `ray start`
(its NODE_ENV included), in a PID namespace of its own (aws_ray_head.py, as test_ray_token_auth.py
starts it). Then a plain driver, which sets no runtime_env and no kvmesh
variable, starts Serve's proxies as `serve deploy` or KubeRay's RayService would: the HTTP proxy
answers a request head over 64 KiB with 431, a limit only the patch gives it (Serve's own proxy
reads the whole head and answers it, here 404: no app). Without the node's hook variable, the same
head gets 404 from the same kind of cluster, so the variable is what brings the limit.
"""

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # raw_http

from aws_ray_head import aws_ray_head  # noqa: E402
from listener_probes import answers_http, answers_kvmesh_grpc, listening_ports  # noqa: E402
from raw_http import connect, request  # noqa: E402
from reliability_support import SMALL_WINDOW_OPTIONS, ray_processes_below, read_on  # noqa: E402
from kvmesh.cluster.local import free_port  # noqa: E402

from kvmesh.cluster.ray_patches import SETUP_HOOK_ENV  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.starts_ray]

MAX_HEADER_BYTES = 65_536  # server.max_header_bytes's default, what the patch applies unset

# Serve's proxies as a deployment tool starts them: no runtime_env, nothing of kvmesh.
DRIVER = """
import sys
import ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="WARNING")
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
print("proxies started", flush=True)
"""

# Whether the app's KV event hub is still an actor of the cluster, and the Serve applications left.
HUB_LEFT = """
import sys
import ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="WARNING")
print("apps:", sorted(serve.status().applications))
try:
    ray.get_actor("kvmesh-kv-events-kvmesh", namespace="serve")
    print("hub: alive")
except ValueError:
    print("hub: gone")
"""


@contextmanager
def ray_head(tmp_path, with_hook: bool):
    """A Ray head started as deploy/aws.yaml's head starts it (without its hook variable unless
    `with_hook`); yields (namespace, GCS address, the environment of a client on the node)."""
    with aws_ray_head(tmp_path, ["--num-cpus=4", "--include-dashboard=false"],
                      leave_out_env=("RAY_", "KVMESH_", "__RAY"),
                      leave_out_head_env=() if with_hook else (SETUP_HOOK_ENV,)) as head:
        yield head.namespace, head.gcs_address, head.shell_env


@pytest.fixture(params=["node env of deploy/aws.yaml", "without the hook variable"])
def serve_on_started_cluster(request, tmp_path):
    http_port = free_port()
    with ray_head(tmp_path, with_hook=request.param == "node env of deploy/aws.yaml") as (namespace, gcs, env):
        driver = subprocess.run(namespace.command([sys.executable, "-c", DRIVER, gcs, str(http_port)]),
                                env=env, capture_output=True, text=True, timeout=300)
        assert driver.returncode == 0 and "proxies started" in driver.stdout, driver.stderr[-3000:]
        yield request.param, http_port


def status_and_head(sock) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    return int(data.split()[1]), data


def test_a_proxy_of_a_cluster_started_with_ray_start_answers_431_only_with_the_node_hook(serve_on_started_cluster):
    case, port = serve_on_started_cluster
    with connect(port) as sock:
        sock.sendall(request("GET", "/v1/models", headers={"X-Fill": "a" * (2 * MAX_HEADER_BYTES)}))
        status, body = status_and_head(sock)
    if case == "node env of deploy/aws.yaml":
        assert status == 431, body
        assert b"max_header_bytes" in body
    else:
        assert status == 404, body  # Serve's own proxy read all of it
    print(f"{case}: a {2 * MAX_HEADER_BYTES}-byte header -> {status}")
    with connect(port) as sock:  # a head within the limit is served either way (no app: 404)
        sock.sendall(request("GET", "/v1/models"))
        assert status_and_head(sock)[0] == 404


@pytest.mark.parametrize("node_hook", [False, True], ids=["nodes without the hook", "nodes with it (ray up)"])
def test_kvmesh_serve_address_brings_the_hook_and_its_configs_settings(tmp_path, node_hook):
    """`kvmesh serve --address`: the job's runtime_env carries the hook and the config's
    server.max_header_bytes to the proxies it starts, whether the nodes name the hook (as
    deploy/aws.yaml's do: the two agree) or not; and it removes the KV event hub when it stops."""
    max_header_bytes = 16_384
    config = tmp_path / "kvmesh.yaml"
    config.write_text(yaml.safe_dump({
        "model": "random:tiny-llama", "engine": {"device": "cpu"},
        "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1},
        "server": {"host": "127.0.0.1", "max_header_bytes": max_header_bytes}}))
    http_port = free_port()
    log = tmp_path / "serve.log"
    with ray_head(tmp_path, with_hook=node_hook) as (namespace, gcs, env), open(log, "w") as out:
        serve = subprocess.Popen(namespace.command([
            sys.executable, "-m", "kvmesh.cli", "serve", str(config), "--address", gcs,
            "--http-port", str(http_port), "--grpc-port", "0"]), env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 420
            while "Ctrl-C stops it." not in log.read_text():
                assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.5)
            with connect(http_port) as sock:
                sock.sendall(request("GET", "/v1/models", headers={"X-Fill": "a" * (max_header_bytes + 1024)}))
                status, head = status_and_head(sock)
            assert status == 431, head
            with connect(http_port) as sock:  # within the config's limit: served by kvmesh
                sock.sendall(request("GET", "/v1/models", headers={"X-Fill": "a" * (max_header_bytes // 2)}))
                status, head = status_and_head(sock)
            assert status == 200, head
            # Run it: "`--grpc-port` (0 = no gRPC), `--direct-http-port` (the ingress replicas' own
            # HTTP port ...; 0 = off)": gRPC 0 here, the direct port at its default 0. Neither is
            # printed, no proxy or ingress port answers kvmesh's gRPC, no ingress port answers HTTP.
            printed = log.read_text()
            assert "gRPC:" not in printed and "(direct to the ingress replicas)" not in printed, printed[-2000:]
            proxies = ray_processes_below(namespace.init_pid, "ProxyActor")
            ingress = ray_processes_below(namespace.init_pid, "Ingress")
            assert proxies and ingress and http_port in listening_ports(proxies), (proxies, ingress)
            assert [p for p in listening_ports(proxies + ingress) if answers_kvmesh_grpc(p)] == []
            assert [p for p in listening_ports(ingress) if answers_http(p)] == []
            # SERVING.md: `kvmesh serve` removes the KV event hub when it stops, also on a Ray
            # cluster it joined (the detached actor would outlive it there); DEPLOY.md: joined with
            # --address, it keeps the app while it runs and deletes it when it stops
            os.kill(namespace.child_of(serve.pid), signal.SIGINT)
            assert serve.wait(120) == 0, log.read_text()[-4000:]
            hub = subprocess.run(namespace.command([sys.executable, "-c", HUB_LEFT, gcs]), env=env,
                                 capture_output=True, text=True, timeout=180)
            assert hub.stdout.strip().endswith("hub: gone"), (hub.stdout, hub.stderr[-2000:])
            assert "apps: []" in hub.stdout, (hub.stdout, hub.stderr[-2000:])
        finally:
            serve.kill()  # nsenter; the namespace's close ends what it started
            serve.wait(30)


def test_kvmesh_serve_address_brings_the_grpc_fixes(tmp_path):
    """SERVING.md "What the patches cover": on a cluster started with `ray start` (nodes without
    the hook variable), `kvmesh serve --address` with gRPC on brings the gRPC fixes to Serve's
    gRPC proxy through the job's runtime_env: malformed request bytes answer INVALID_ARGUMENT
    (Serve's own: UNKNOWN), a cancelled call stops its request on the engine, and a stream nobody
    reads is cut after the config's stream_idle_timeout_s with CANCELLED naming the setting."""
    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    config = tmp_path / "kvmesh.yaml"
    config.write_text(yaml.safe_dump({
        "model": "random:tiny-llama", "engine": {"device": "cpu"},
        "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1},
        "server": {"host": "127.0.0.1", "stream_idle_timeout_s": 3}}))
    http_port, grpc_port = free_port(), free_port()
    target = f"127.0.0.1:{grpc_port}"
    log = tmp_path / "serve.log"

    def idle() -> bool:
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/kvmesh/workers", timeout=30) as resp:
            return all(w["running"] == 0 and w["waiting"] == 0 for w in json.load(resp)["workers"])

    def wait_idle(timeout_s: float) -> float:
        started = time.monotonic()
        while not idle():
            assert time.monotonic() - started < timeout_s, "the engine still runs the request"
            time.sleep(0.1)
        return time.monotonic() - started

    with ray_head(tmp_path, with_hook=False) as (namespace, gcs, env), open(log, "w") as out:
        serve = subprocess.Popen(namespace.command([
            sys.executable, "-m", "kvmesh.cli", "serve", str(config), "--address", gcs,
            "--http-port", str(http_port), "--grpc-port", str(grpc_port)]), env=env, stdout=out,
            stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 420
            while "Ctrl-C stops it." not in log.read_text():
                assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.5)
            with grpc.insecure_channel(target) as channel:
                raw = channel.unary_stream("/kvmesh.v1.Generation/Generate", request_serializer=None,
                                           response_deserializer=None)
                with pytest.raises(grpc.RpcError) as e:
                    list(raw(b"\xff\xff\xff\xff", timeout=60))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
                stub = pb_grpc.GenerationStub(channel)
                call = stub.Generate(pb.GenerateRequest(prompt="cancel me", max_tokens=1800, temperature=0,
                                                        ignore_eos=True), timeout=120)
                next(call)
                call.cancel()
                cancelled_idle_s = wait_idle(15)
            channels = [grpc.insecure_channel(target, options=SMALL_WINDOW_OPTIONS) for _ in range(8)]
            try:
                streams = [pb_grpc.GenerationStub(c).Generate(pb.GenerateRequest(
                    prompt=f"unread {i}", max_tokens=1900, temperature=0, ignore_eos=True,
                    request_id=f"unread-{i}-" + "x" * 240), timeout=180) for i, c in enumerate(channels)]
                for s in streams:
                    next(s)
                wait_idle(120)
                statuses = [read_on(s)[1] for s in streams]
            finally:
                for c in channels:
                    c.close()
            print(f"kvmesh serve --address, gRPC: a cancel idle after {cancelled_idle_s:.2f} s; "
                  f"unread streams: {sorted(set(map(str, statuses)))}")
            assert all(s is not None and s[0] == grpc.StatusCode.CANCELLED
                       and "server.stream_idle_timeout_s" in s[1] for s in statuses), statuses
            os.kill(namespace.child_of(serve.pid), signal.SIGINT)
            assert serve.wait(120) == 0, log.read_text()[-4000:]
        finally:
            serve.kill()  # nsenter; the namespace's close ends what it started
            serve.wait(30)
