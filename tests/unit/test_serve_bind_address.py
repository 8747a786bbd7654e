"""Which address Serve's gRPC proxy binds under the worker hook's bind patch
(cluster/serve_bind_address.py): `server.host` where the launcher or the Helm chart set it, and
Serve's own every-interface address where nothing did (a cluster whose nodes name only the hook:
its API port must stay reachable by clients on other machines). Real grpc.aio servers in a fresh
interpreter, as a Ray worker process runs the patch."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed")

BIND = """
import asyncio, psutil, grpc
from kvmesh.cluster import serve_bind_address
serve_bind_address.apply()
from ray.serve._private import default_impl

async def main():
    server = grpc.aio.server()
    default_impl.add_grpc_address(server, "[::]:0")  # what Serve's gRPC proxy asks for
    await server.start()
    me = psutil.Process()
    print(sorted({c.laddr.ip for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}))
    await server.stop(None)

asyncio.run(main())
"""


def listening_addresses(host: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_LISTEN_HOST"}
    if host is not None:
        env["KVMESH_LISTEN_HOST"] = host
    done = subprocess.run([sys.executable, "-c", BIND], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_the_grpc_proxy_binds_the_configured_host():
    # gRPC's sockets are dual-stack: IPv4 127.0.0.1 shows as its mapped form, the same address
    assert listening_addresses("127.0.0.1") == "['::ffff:127.0.0.1']"


def test_without_a_configured_host_the_grpc_proxy_keeps_serves_every_interface_bind():
    assert listening_addresses(None) == "['::']"


REPLICA = """
import asyncio, psutil, grpc, ray.util
ray.util.get_node_ip_address = lambda: "127.0.0.1"  # the node's IP as Ray reports it on a loopback node
from kvmesh.cluster import serve_bind_address
serve_bind_address.apply()
from ray.serve._private import replica

async def main():
    server = grpc.aio.server()
    replica.add_port_to_grpc_server(server, "[::]:0")  # what each replica asks for its own server
    await server.start()
    me = psutil.Process()
    print(sorted({c.laddr.ip for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}))
    await server.stop(None)

asyncio.run(main())
"""


@pytest.mark.parametrize("host", [None, "::1"])
def test_a_replicas_own_grpc_server_binds_the_node_ip_whatever_the_listen_host(host):
    # its callers dial <node ip>:<port>; server.host (KVMESH_LISTEN_HOST) is the proxies' address
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_LISTEN_HOST"}
    if host is not None:
        env["KVMESH_LISTEN_HOST"] = host
    done = subprocess.run([sys.executable, "-c", REPLICA], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() in ("['127.0.0.1']", "['::ffff:127.0.0.1']")
