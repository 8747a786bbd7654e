"""StreamIdleTimeout (cluster/stream_idle_timeout.py) on a real uvicorn server on 127.0.0.1, around
an app that streams like Serve's proxy (it stops when receive() says http.disconnect): a client that
reads nothing is cut after the timeout and the app learns it; a client that reads more slowly than
the app writes, so that uvicorn's send waits longer than the timeout, is not cut and gets it all."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from kvmesh.cluster.local import free_port
from kvmesh.cluster.stream_idle_timeout import StreamIdleTimeout

TIMEOUT_S = 0.5
CHUNK = b"x" * 1023 + b"\n"
NUM_CHUNKS = 600  # 600 KiB: far more than the socket buffers and uvicorn's 64 KiB


class StreamingApp:
    """Writes NUM_CHUNKS as fast as send lets it; stops at a disconnect, as Serve's proxy does."""

    def __init__(self):
        self.ended = threading.Event()
        self.chunks_sent = 0
        self.disconnected = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()  # the request body

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(NUM_CHUNKS):
                if watcher.done():
                    self.disconnected = True
                    return
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
                self.chunks_sent += 1
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.ended.set()


@pytest.fixture
def server():
    app = StreamingApp()
    port = free_port()
    config = uvicorn.Config(StreamIdleTimeout(app, timeout_s=TIMEOUT_S), host="127.0.0.1",
                            port=port, log_level="critical", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    yield app, port
    srv.should_exit = True
    thread.join(30)


def small_buffer_client(port: int, rcvbuf: int) -> socket.socket:
    """A client whose socket buffers are those of a real network: loopback's 64 KiB MSS would let
    Linux give the server's socket a ~4 MiB send buffer; 1448 (Ethernet) gives ~100 KiB."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1448)
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return s


def test_a_client_that_reads_nothing_is_cut_and_the_app_stops(server):
    app, port = server
    client = small_buffer_client(port, rcvbuf=4096)
    try:
        assert client.recv(64).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert app.ended.wait(TIMEOUT_S + 20), "the app was not stopped"
        assert app.disconnected and app.chunks_sent < NUM_CHUNKS
        assert time.monotonic() - started >= TIMEOUT_S
        with pytest.raises(ConnectionResetError):  # aborted: reset, not a clean end of the body
            while client.recv(65536):
                pass
    finally:
        client.close()


def test_a_slow_reader_is_not_cut_and_gets_everything(server):
    app, port = server
    client = small_buffer_client(port, rcvbuf=8192)
    received = bytearray()
    try:
        # 8 KiB per 0.1 s: uvicorn's send waits for 48 KiB to drain, ~0.6 s > TIMEOUT_S
        while not received.endswith(b"0\r\n\r\n"):
            data = client.recv(8192)
            assert data, "the server closed the connection"
            received += data
            time.sleep(0.1)
    finally:
        client.close()
    assert app.ended.wait(10) and not app.disconnected
    assert app.chunks_sent == NUM_CHUNKS
    assert received.count(CHUNK) == NUM_CHUNKS
