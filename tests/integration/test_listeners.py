"""Every listener of a local `kvmesh serve` process tree binds the configured address, and a raw
connection to a Serve replica's internal gRPC server (which unpickles what it receives) runs
nothing without Ray's auth token (issue 13, point 1; docs/SERVING.md "Network model").

The cluster runs as a user's does: Ray token auth on (LocalCluster(ray_auth=True)), gRPC and the
direct HTTP port on, two CPU worker replicas, an API key, and gRPC reflection turned on (off by
default: tests/integration/test_transport_limits.py).
"""

from __future__ import annotations

import ipaddress
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import psutil
import pytest
import yaml

from kvmesh.cluster.local import LocalCluster, free_port
from reliability_support import ray_processes

MODEL = "random:tiny-llama"
# Generous: on a shared 2-core machine Ray + Serve + 3 replicas took up to 170 s to start.
START_TIMEOUT_S = 420
HOST = "127.0.0.1"
HANDLE_REQUEST = "/ray.serve.ASGIService/HandleRequest"
KEY = "sk-listeners"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    direct_port = free_port()
    config = tmp_path_factory.mktemp("cfg") / "listeners.yaml"
    config.write_text(yaml.safe_dump({"server": {"grpc_reflection": True}}))
    with LocalCluster(["--replicas", "2", "--device", "cpu", "--model", MODEL,
                       "--direct-http-port", str(direct_port), "--api-key", KEY],
                      config=str(config), ray_auth=True, start_timeout_s=START_TIMEOUT_S) as c:
        c.direct_http_port = direct_port
        yield c


def listeners(root_pid: int) -> list[tuple[int, str, str, int]]:
    """(pid, process title, address, port) of every listening TCP socket and bound UDP socket of
    `root_pid` and its descendants (Ray's GCS, raylet, agents and workers are all below it).
    gRPC binds 127.0.0.1 as an IPv6 socket on ::ffff:127.0.0.1, the same address: shown as such."""
    root = psutil.Process(root_pid)
    found = []
    for proc in [root] + root.children(recursive=True):
        try:
            title = " ".join(proc.cmdline())[:120]
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue  # a process that ended while we looked
        for conn in conns:
            udp = conn.type == socket.SOCK_DGRAM  # bound, never LISTEN
            if conn.status == psutil.CONN_LISTEN or (udp and conn.laddr and not conn.raddr):
                address = ipaddress.ip_address(conn.laddr.ip)
                ip = str(getattr(address, "ipv4_mapped", None) or address)
                found.append((proc.pid, title, ip, conn.laddr.port))
    return found


def test_every_listener_of_the_process_tree_binds_the_configured_address(cluster):
    found = listeners(cluster.proc.pid)
    print(f"{len(found)} listeners:")
    for pid, title, ip, port in sorted(found, key=lambda f: f[3]):
        print(f"  {ip}:{port}  pid {pid}  {title}")
    offenders = [f for f in found if f[2] != HOST]
    assert not offenders, "listeners off the configured address (pid, title, address, port):\n" + \
        "\n".join(map(str, offenders))
    ports = {port for _, _, _, port in found}
    # Not vacuous: the proxies, the direct port and Ray's GCS are among them.
    assert {cluster.http_port, cluster.grpc_port, cluster.direct_http_port,
            int(cluster.ray_address.rsplit(":", 1)[1])} <= ports
    for role in ("Ingress", "KVWorker"):  # each replica has its internal gRPC server
        for proc in ray_processes(cluster, role):
            assert any(pid == proc.pid for pid, *_ in found), f"no listener found in {role} {proc.pid}"


class _CreatesFile:
    """A pickle that, when loaded, creates the file `path` (harmless evidence that code ran)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "x"))


def _send_pickle(port: int, marker: str, metadata=None) -> grpc.StatusCode:
    from ray.serve.generated.serve_pb2 import ASGIRequest

    payload = pickle.dumps(_CreatesFile(marker))
    request = ASGIRequest(pickled_request_metadata=payload, request_args=payload,
                          request_kwargs=payload).SerializeToString()
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        call = channel.unary_unary(HANDLE_REQUEST, request_serializer=None,
                                   response_deserializer=None)
        try:
            call(request, timeout=20, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_a_pickle_sent_to_a_replica_port_without_the_token_runs_nothing(cluster):
    with open(cluster.token_path) as f:
        token = f.read().strip()
    for role in ("Ingress", "KVWorker"):
        replica = ray_processes(cluster, role)[0]
        ports = [port for pid, _, _, port in listeners(cluster.proc.pid) if pid == replica.pid]
        marker = os.path.join(tempfile.mkdtemp(prefix="kvmesh-pickle-"), "ran")
        codes = {port: _send_pickle(port, marker) for port in ports}
        assert not os.path.exists(marker), f"{role}: a pickle without the token ran code: {codes}"
        assert grpc.StatusCode.UNAUTHENTICATED in codes.values(), codes
        # The same bytes with Ray's token do run (so the ports tried include the server that
        # unpickles, and the payload is one that would have worked): the token is what stops it.
        for port in ports:
            _send_pickle(port, marker, metadata=(("authorization", f"Bearer {token}"),))
        assert os.path.exists(marker), f"{role}: the control payload never ran ({ports})"


def _status_with_token(cluster, token_path: str) -> subprocess.CompletedProcess:
    env = dict(cluster.ray_env, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", "status", "--address",
                           cluster.ray_address, "--json"], env=env, capture_output=True, text=True,
                          timeout=180)


def test_ray_itself_needs_the_token_and_works_with_it(cluster):
    """`kvmesh status --address` joins Ray as any driver (or `kvmesh serve --address`) does."""
    done = _status_with_token(cluster, cluster.token_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads(done.stdout)["workers"]) == 2
    with tempfile.NamedTemporaryFile("w", prefix="kvmesh-wrong-token-") as wrong:
        wrong.write("0" * 64)
        wrong.flush()
        refused = _status_with_token(cluster, wrong.name)
    assert refused.returncode != 0
    assert "auth" in (refused.stderr + refused.stdout).lower(), refused.stderr[-3000:]


def test_reflection_when_turned_on_lists_the_service_even_without_a_key(cluster):
    """Serve runs reflection on the proxy itself, outside the ingress that checks keys: it cannot
    be put behind the API key, which is why it is off by default."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=30))
    services = {s.name for s in answers[0].list_services_response.service}
    assert "kvmesh.v1.Generation" in services


def test_reflection_v1_is_served_beside_v1alpha(cluster):
    """grpc.reflection.v1 has v1alpha's messages under another name: the same stubs' messages
    on the v1 method path. It lists Generation and the standard health service."""
    from grpc_reflection.v1alpha import reflection_pb2

    with grpc.insecure_channel(cluster.grpc_target) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        answers = list(call(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvmesh.v1.Generation"),
        ]), timeout=30))
    services = {s.name for s in answers[0].list_services_response.service}
    assert {"kvmesh.v1.Generation", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection"} <= services
    assert answers[1].file_descriptor_response.file_descriptor_proto  # the service's .proto


def test_ctrl_c_stops_the_whole_tree_cleanly(cluster):
    """docs/DEPLOY.md: Ctrl-C (SIGINT) deletes the app, ends the hub and stops Ray: `kvmesh serve`
    exits 0 by itself (LocalCluster would SIGKILL its session after 60 s), prints no error on the
    way (Serve's own shutdown printed Ray's "Task ServeController.graceful_shutdown failed") and
    leaves no process of its tree. Runs last in this module: it stops the module's cluster."""
    tree = [cluster.proc.pid] + [p.pid for p in psutil.Process(cluster.proc.pid).children(recursive=True)]
    assert len(tree) > 3  # Ray's GCS, raylet, Serve's controller, proxies and replicas
    cluster.stop(timeout_s=60)
    assert cluster.proc.returncode == 0, cluster.log()[-3000:]
    log = cluster.log()
    assert "Deleting app" in log, log[-3000:]
    stopping = log.rsplit("Deleting app", 1)[1]  # what the stop printed
    assert not re.search(r"Traceback|Error|failed", stopping), stopping[-3000:]
    deadline = time.monotonic() + 30  # Ray's own processes end just after the driver
    while (alive := running(tree)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, alive


def running(pids: list[int]) -> list[str]:
    """The command lines of those of `pids` still running (not exited, not a zombie)."""
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} " + " ".join(proc.cmdline())[:100])
        except psutil.Error:
            pass  # gone
    return out
