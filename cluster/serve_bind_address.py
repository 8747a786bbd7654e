"""Keep Serve's own servers off the network the operator did not open.

Ray Serve 2.60 binds two servers to every interface (`[::]`) whatever `http_options.host` says,
and has no setting for either:
- each replica's internal gRPC server (proxy -> replica and handle calls in the throughput-optimized
  mode), which unpickles what it receives: `ray.serve._private.replica` calls
  `add_port_to_grpc_server(self._server, "[::]:0")`. Its callers dial `<node ip>:<port>`, so it
  binds the node's IP: 127.0.0.1 for a local `kvmesh serve` on loopback; on a multi-node cluster
  the address the other nodes reach it at (never loopback by force: their proxies and ingress
  replicas call it; Ray's token authentication guards it, docs/DEPLOY.md "Network model").
- the gRPC proxy: `ray.serve._private.grpc_util.start_grpc_server` calls
  `default_impl.add_grpc_address(server, "[::]:<port>")`. It binds `server.host`, as the HTTP
  proxy does (KVMESH_LISTEN_HOST, which `kvmesh serve` sets for the processes it starts or
  deploys, and the Helm chart on every pod); where nothing set it (a cluster whose node
  definitions name only the hook) it stays on every interface, as the API port of a cluster must
  be reachable by its clients.
Both targets are checked when applied, so a Ray upgrade that moves them fails loudly at start-up;
tests/integration/test_listeners.py checks the addresses themselves.
"""

from __future__ import annotations

import os

ALL_INTERFACES = "[::]:"
HOST_ENV = "KVMESH_LISTEN_HOST"


def _bind_host(address: str, host: str) -> str:
    if not address.startswith(ALL_INTERFACES):
        return address
    port = address[len(ALL_INTERFACES):]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def apply() -> None:
    import ray
    from ray.serve._private import default_impl, replica

    proxy_host = os.environ.get(HOST_ENV)
    add_replica_port = replica.add_port_to_grpc_server
    add_proxy_address = default_impl.add_grpc_address

    def add_port_to_grpc_server(server, address):
        return add_replica_port(server, _bind_host(address, ray.util.get_node_ip_address()))

    def add_grpc_address(server, address):
        if proxy_host is None:
            return add_proxy_address(server, address)
        return add_proxy_address(server, _bind_host(address, proxy_host))

    replica.add_port_to_grpc_server = add_port_to_grpc_server
    default_impl.add_grpc_address = add_grpc_address
