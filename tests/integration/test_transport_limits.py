"""Transport limits of a live cluster, before any work and without an API key (issue 13, points
2, 6 and 8; docs/RELIABILITY.md "Listeners and transport limits"):

- HTTP request heads over server.max_header_bytes get 431 on Serve's proxy and on the direct port,
  and 64 MB heads do not grow the proxy;
- heads not complete within server.header_timeout_s get 408 and are closed, on both, and idle
  kept-alive connections are closed after server.keep_alive_timeout_s;
- gRPC messages over server.grpc_max_message_bytes get RESOURCE_EXHAUSTED without the proxy or
  the ingress growing; malformed request bytes get INVALID_ARGUMENT; reflection is off by default.
"""

from __future__ import annotations

import json
import time
import uuid

import grpc
import pytest
from raw_http import closed_by_server, connect, read_response, request, trickle_until_answered
from cluster_support import MODEL, config_cluster, cpu_config
from reliability_support import auth, http, ray_processes, rss_mb

from kvmesh.cluster.local import free_port

pytestmark = pytest.mark.slow

# Generous: on a shared 2-core machine Ray + Serve + 3 replicas took up to 170 s to start.
START_TIMEOUT_S = 420
KEY = "sk-" + uuid.uuid4().hex
MAX_HEADER_BYTES = 65_536  # the default
HEADER_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 3
MAX_GRPC_BYTES = 4 * 1024 * 1024  # the default
GENERATE = "/kvmesh.v1.Generation/Generate"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    direct_port = free_port()
    config = cpu_config(server={"direct_http_port": direct_port, "header_timeout_s": HEADER_TIMEOUT_S,
                                "keep_alive_timeout_s": KEEP_ALIVE_S})
    with config_cluster(tmp_path_factory, config, ["--api-key", KEY],
                        start_timeout_s=START_TIMEOUT_S) as c:
        c.direct_http_port = direct_port
        yield c


def http_ports(cluster) -> dict[str, int]:
    return {"proxy": cluster.http_port, "direct": cluster.direct_http_port}


# ---- HTTP --------------------------------------------------------------------------------------

def test_a_head_over_the_limit_gets_431_on_the_proxy_and_the_direct_port(cluster):
    for name, port in http_ports(cluster).items():
        with connect(port) as sock:  # no key: refused before the ingress sees anything
            sock.sendall(request("POST", "/v1/completions",
                                 headers={"X-Fill": "a" * (2 * MAX_HEADER_BYTES)}))
            status, body = read_response(sock)
            assert status == 431, (name, body)
            assert json.loads(body)["error"]["code"] == "request_headers_too_large"
            assert closed_by_server(sock)
        # Just under the limit, with the key: served.
        status, body, _ = http(f"http://127.0.0.1:{port}/v1/models",
                               headers={**auth(KEY), "X-Fill": "a" * (MAX_HEADER_BYTES - 1024)})
        assert status == 200 and body["data"][0]["id"] == MODEL, (name, body)


def _send_huge_head(port: int, size: int) -> None:
    """Start a request whose head is `size` bytes; the server closes after its limit."""
    piece = b"a" * (1024 * 1024)
    with connect(port) as sock:
        try:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Fill: ")
            for _ in range(size // len(piece)):
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return
        raise AssertionError(f"port {port} read a {size}-byte head without closing")


def test_64mb_heads_do_not_grow_the_proxy(cluster):
    proxy = ray_processes(cluster, "ProxyActor")
    before = rss_mb(proxy)
    for _ in range(12):
        _send_huge_head(cluster.http_port, 64 * 1024 * 1024)
    after = rss_mb(proxy)
    print(f"HTTP proxy RSS: {before:.0f} MB before, {after:.0f} MB after 12 x 64 MB heads")
    assert after - before < 50


def test_a_slow_head_is_closed_within_the_timeout_on_the_proxy_and_the_direct_port(cluster):
    for name, port in http_ports(cluster).items():
        with connect(port) as sock:
            elapsed, answer = trickle_until_answered(sock)
        assert answer.startswith(b"HTTP/1.1 408"), (name, answer)
        assert HEADER_TIMEOUT_S - 0.1 <= elapsed < HEADER_TIMEOUT_S + 3, (name, elapsed)


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_time(cluster):
    for name, port in http_ports(cluster).items():
        with connect(port) as sock:
            sock.sendall(request("GET", "/health"))
            assert read_response(sock)[0] == 200, name
            started = time.monotonic()
            sock.settimeout(KEEP_ALIVE_S + 10)
            assert closed_by_server(sock), name
            elapsed = time.monotonic() - started
        assert KEEP_ALIVE_S - 0.5 <= elapsed < KEEP_ALIVE_S + 3, (name, elapsed)


# ---- gRPC --------------------------------------------------------------------------------------

def _raw_generate(cluster, payload: bytes, key: str | None = KEY):
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list(call(payload, timeout=60, metadata=metadata))
    return e.value


def test_malformed_request_bytes_get_invalid_argument(cluster):
    for payload in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab"):
        error = _raw_generate(cluster, payload)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (payload, error)
        assert "kvmesh.v1.GenerateRequest" in error.details()
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        list_models = channel.unary_unary("/kvmesh.v1.Generation/ListModels",
                                          request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list_models(b"\xff\xff", timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_message_over_the_limit_gets_resource_exhausted_without_growing_the_servers(cluster):
    from kvmesh.proto import kvmesh_pb2 as pb

    servers = ray_processes(cluster, "ProxyActor") + ray_processes(cluster, "Ingress")
    before = rss_mb(servers)
    payload = pb.GenerateRequest(model=MODEL, prompt="a" * (64 * 1024 * 1024)).SerializeToString()
    for _ in range(4):
        error = _raw_generate(cluster, payload, key=None)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    just_over = pb.GenerateRequest(model=MODEL, prompt="a" * MAX_GRPC_BYTES).SerializeToString()
    assert _raw_generate(cluster, just_over).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    after = rss_mb(servers)
    print(f"gRPC proxy + ingress RSS: {before:.0f} MB before, {after:.0f} MB after "
          "4 x 64 MB messages")
    assert after - before < 50


def test_a_message_just_under_the_limit_reaches_the_ingress(cluster):
    """RELIABILITY.md: a message the proxy accepts also reaches the ingress replica, re-wrapped
    (Serve's proxy-to-replica limit is the proxy's plus 1 MiB), and is decoded before the key is
    checked: without a key UNAUTHENTICATED, with it the ingress's own answer (here the prompt's
    character limit), never RESOURCE_EXHAUSTED from the hop between them."""
    from kvmesh.proto import kvmesh_pb2 as pb

    def message(size: int) -> bytes:
        chars = size - len(pb.GenerateRequest(model=MODEL, prompt="a").SerializeToString()) - 4
        payload = pb.GenerateRequest(model=MODEL, prompt="a" * chars).SerializeToString()
        assert size - 8 <= len(payload) <= size, len(payload)
        return payload

    just_under = message(MAX_GRPC_BYTES)
    error = _raw_generate(cluster, just_under, key=None)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
    error = _raw_generate(cluster, just_under)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "prompt" in error.details() and "characters" in error.details(), error.details()


def test_reflection_is_off_by_default(cluster):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_the_direct_port_needs_the_key_as_the_proxy_does(cluster):
    for name, port in http_ports(cluster).items():
        base = f"http://127.0.0.1:{port}"
        for headers in ({}, auth("sk-wrong"), {"Authorization": KEY}):
            status, body, hdrs = http(base + "/v1/models", headers=headers, method="GET")
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (name, headers, body)
            assert hdrs["WWW-Authenticate"] == "Bearer", name
            status, body, _ = http(base + "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1},
                                   headers)
            assert status == 401 and body["error"]["type"] == "authentication_error", (name, headers, body)
        status, body, _ = http(base + "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1},
                               auth(KEY))
        assert status == 200 and body["usage"]["completion_tokens"] == 1, (name, body)


def test_the_server_keeps_serving_after_all_of_the_above(cluster):
    status, body, _ = http(cluster.http_url + "/v1/completions",
                           {"model": MODEL, "prompt": "hello", "max_tokens": 4}, auth(KEY))
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
