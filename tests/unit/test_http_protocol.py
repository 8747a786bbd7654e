"""The bounded uvicorn protocol (cluster/http_protocol.py) on a real uvicorn server on 127.0.0.1:
request heads over the size limit get 431 before the rest is read, heads not complete in time get
408, bodies are not counted as head, and the bounds hold again for the next request of a
kept-alive connection."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from raw_http import closed_by_server, connect, read_response, request, trickle_until_answered

from kvmesh.cluster.http_protocol import bounded_protocol
from kvmesh.cluster.local import free_port

MAX_HEADER_BYTES = 4096
HEADER_TIMEOUT_S = 1.0


async def echo_length(scope, receive, send):
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = str(len(body)).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def server_port():
    port = free_port()
    config = uvicorn.Config(echo_length, host="127.0.0.1", port=port, lifespan="off",
                            log_level="warning", timeout_keep_alive=30,
                            http=bounded_protocol(MAX_HEADER_BYTES, HEADER_TIMEOUT_S))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def test_a_request_within_the_bounds_is_served(server_port):
    with connect(server_port) as sock:
        sock.sendall(request(headers={"X-Fill": "a" * (MAX_HEADER_BYTES - 200)}))
        assert read_response(sock) == (200, b"0")


def test_a_head_over_the_limit_gets_431_naming_the_setting_and_is_closed(server_port):
    with connect(server_port) as sock:
        try:  # the server closes after the limit: the rest may not be sendable
            sock.sendall(request(headers={"X-Fill": "a" * (16 * MAX_HEADER_BYTES)}))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, body = read_response(sock)
        assert status == 431
        error = json.loads(body)["error"]
        assert error["code"] == "request_headers_too_large"
        assert f"{MAX_HEADER_BYTES} bytes (server.max_header_bytes)" in error["message"]
        assert closed_by_server(sock)


def test_a_body_larger_than_the_head_limit_is_not_counted_as_head(server_port):
    with connect(server_port) as sock:
        sock.sendall(request(body=b"x" * (8 * MAX_HEADER_BYTES)))
        assert read_response(sock) == (200, str(8 * MAX_HEADER_BYTES).encode())


def test_a_slow_head_gets_408_and_is_closed_within_the_timeout(server_port):
    with connect(server_port) as sock:
        elapsed, answer = trickle_until_answered(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout" and "server.header_timeout_s" in error["message"]
    assert HEADER_TIMEOUT_S - 0.05 <= elapsed < HEADER_TIMEOUT_S + 2


def test_the_next_request_on_a_kept_alive_connection_has_the_same_bounds(server_port):
    with connect(server_port) as sock:
        sock.sendall(request())
        assert read_response(sock) == (200, b"0")
        time.sleep(HEADER_TIMEOUT_S * 1.5)  # idle between requests: the keep-alive time, not this
        elapsed, answer = trickle_until_answered(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert elapsed < HEADER_TIMEOUT_S + 2
