"""What answers on a process's listening ports: a kvmesh HTTP server or kvmesh's gRPC API, told
apart from the Ray-internal gRPC servers every Ray worker process also runs."""

from __future__ import annotations

import socket

import grpc
import psutil


def listening_ports(processes) -> set[int]:
    """The TCP ports `processes` listen on."""
    ports = set()
    for proc in processes:
        try:
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue  # ended meanwhile
        ports |= {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
    return ports


def answers_http(port: int, timeout_s: float = 10.0) -> bool:
    """Whether 127.0.0.1:port answers `GET /health` over HTTP/1.1 (any status)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return sock.recv(16).startswith(b"HTTP/1.")
    except OSError:
        return False


def answers_kvmesh_grpc(port: int, timeout_s: float = 10.0) -> bool:
    """Whether 127.0.0.1:port answers grpc.health.v1 Check for kvmesh.v1.Generation (SERVING or
    not): only kvmesh's gRPC API (Serve's gRPC proxy) knows that service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvmesh.v1.Generation"), timeout=timeout_s)
            return True
        except grpc.RpcError:
            return False
