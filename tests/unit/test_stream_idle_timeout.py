"""StreamIdleTimeout (cluster/stream_idle_timeout.py) on a real uvicorn server on 127.0.0.1, around
an app that streams like Serve's proxy (it stops when receive() says http.disconnect): a client that
reads nothing is cut after the timeout and the app learns it; a client that reads more slowly than
the app writes, so that uvicorn's send waits longer than the timeout, is not cut and gets it all.
A timeout of 0 is off: the ingress's direct port does not cut a client that reads nothing, and
apply() leaves Serve's proxies unwrapped.
The same two cases for gRPC's with_write_deadline, on a real grpc.aio server and client (a reader
that does not stop is not timed out; one that stops is, and still gets what was queued, then the
error status)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import grpc
import pytest
import uvicorn

from kvmesh.cluster.local import free_port
from kvmesh.cluster.stream_idle_timeout import StreamIdleTimeout, grpc_timeout_details, with_write_deadline

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


def test_a_client_on_loopback_s_own_segment_size_that_reads_nothing_is_cut_too(server):
    """Without the Ethernet MSS, Linux grew the server socket's send buffer to ~4 MiB on loopback
    and the whole 600 KiB response vanished into it: no send waited, nothing was cut (the backpressure
    test's rare failure). The middleware fixes the send buffer (SEND_BUFFER_BYTES)."""
    app, port = server
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        client.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert client.recv(64).startswith(b"HTTP/1.1 200")
        assert app.ended.wait(TIMEOUT_S + 20), "the app was not stopped"
        assert app.disconnected and app.chunks_sent < NUM_CHUNKS
    finally:
        client.close()


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


def test_a_timeout_of_0_on_the_direct_port_never_cuts_a_client_that_reads_nothing():
    """docs/RELIABILITY.md: `server.stream_idle_timeout_s: 0` turns the timeout off. The ingress's
    direct port (cluster/direct_http.serve_direct, real uvicorn on 127.0.0.1) then leaves a client
    that reads nothing connected, the app waiting on its full buffer, and it gets everything once
    it reads. (A timeout of 0 applied would cut it at the first send that waits.)"""
    from kvmesh.cluster.direct_http import serve_direct, shared_socket
    from kvmesh.serve_config import parse_config

    app = StreamingApp()
    port = free_port()
    sock = shared_socket("127.0.0.1", port)
    loop = asyncio.new_event_loop()
    serving = loop.create_task(serve_direct(
        app, sock, parse_config({"server": {"stream_idle_timeout_s": 0}}).server))

    def run():
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(serving)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    client = small_buffer_client(port, rcvbuf=4096)
    try:
        received = bytearray(client.recv(64))
        assert received.startswith(b"HTTP/1.1 200")
        time.sleep(2 * TIMEOUT_S)  # reading nothing while the app's sends wait
        assert not app.ended.is_set() and 0 < app.chunks_sent < NUM_CHUNKS
        while not received.endswith(b"0\r\n\r\n"):
            data = client.recv(65536)
            assert data, "the server closed the connection"
            received += data
    finally:
        client.close()
        app.ended.wait(10)
        loop.call_soon_threadsafe(serving.cancel)
        thread.join(10)
        loop.close()
        sock.close()
    assert app.ended.is_set() and not app.disconnected
    assert app.chunks_sent == NUM_CHUNKS and received.count(CHUNK) == NUM_CHUNKS


def test_a_timeout_of_0_leaves_serves_proxies_as_they_are(monkeypatch):
    """The launcher passes `server.stream_idle_timeout_s: 0` to Serve's proxies as
    KVMESH_STREAM_IDLE_TIMEOUT_S (listener_env); apply() then wraps neither proxy (a timeout above
    0 wraps both: the check below would see it)."""
    from ray.serve._private import proxy

    from kvmesh.cluster.launcher import listener_env
    from kvmesh.cluster.stream_idle_timeout import TIMEOUT_ENV, apply
    from kvmesh.serve_config import parse_config

    http, grpc_factory = proxy.configure_http_middlewares, proxy.gRPCProxy.service_handler_factory
    # put back Serve's own functions after the test, whatever apply() did
    monkeypatch.setattr(proxy, "configure_http_middlewares", http)
    monkeypatch.setattr(proxy.gRPCProxy, "service_handler_factory", grpc_factory)

    off = listener_env(parse_config({"server": {"stream_idle_timeout_s": 0}}))[TIMEOUT_ENV]
    monkeypatch.setenv(TIMEOUT_ENV, off)
    apply()
    assert proxy.configure_http_middlewares is http
    assert proxy.gRPCProxy.service_handler_factory is grpc_factory

    monkeypatch.setenv(TIMEOUT_ENV, "5")
    apply()
    assert proxy.configure_http_middlewares is not http
    assert proxy.gRPCProxy.service_handler_factory is not grpc_factory


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


# ---- gRPC ----------------------------------------------------------------------------------------

GRPC_MESSAGE = b"y" * 16384
GRPC_NUM_MESSAGES = 1000  # 16 MiB: more than gRPC buffers for a stream on loopback (~6 MiB here)
GRPC_METHOD = "/kvmesh.test.Stream/Numbers"
# gRPC lets a write go only after the client has drained a large part of the stream's buffers, so
# a reader behind a full buffer sees waits of buffer / read rate (measured here: up to 0.74 s at
# 2.6 MB/s, 5.3 s at 750 KB/s): the timeout is a bound on that wait, not on time without a read.
GRPC_TIMEOUT_S = 2.0


class StreamingServicer:
    """A server-streaming handler that yields GRPC_NUM_MESSAGES as fast as gRPC writes them, behind
    with_write_deadline. Its timeout stops it as Serve's proxy stops when its replica call is
    cancelled: no more messages, then an error status."""

    def __init__(self, after_timeout: str = "status"):
        self.timeouts = 0
        self.messages_yielded = 0
        self.after_timeout = after_timeout  # "status": ends with INTERNAL; "raise": raises

    def on_timeout(self, context):
        self.timeouts += 1

    async def numbers(self, request, context):
        for _ in range(GRPC_NUM_MESSAGES):
            if self.timeouts and self.after_timeout == "raise":
                raise RuntimeError("the replica call was cancelled")
            if self.timeouts:  # what Serve's proxy answers when its replica call was cancelled
                context.set_code(grpc.StatusCode.INTERNAL)
                context.set_details("Request 0123 was cancelled.")
                return
            self.messages_yielded += 1
            yield GRPC_MESSAGE


@contextlib.asynccontextmanager
async def grpc_stream(servicer: StreamingServicer, timeout_s: float):
    """A grpc.aio server of servicer.numbers behind with_write_deadline on 127.0.0.1, and a call
    to it from a grpc.aio client."""
    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(
        with_write_deadline(servicer.numbers, GRPC_TIMEOUT_S, servicer.on_timeout))
    service, method = GRPC_METHOD.rsplit("/", 1)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service[1:], {method: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel.unary_stream(GRPC_METHOD)(b"", timeout=timeout_s)
    finally:
        await server.stop(None)


@pytest.mark.parametrize("after_timeout", ["status", "raise"])
def test_a_grpc_client_that_reads_nothing_times_out_and_then_gets_what_was_queued_and_cancelled(after_timeout):
    async def main():
        servicer = StreamingServicer(after_timeout)
        async with grpc_stream(servicer, timeout_s=60) as call:
            # from before the first read: the server's write may start waiting before that read
            # returns (one event loop runs both; under load, a while before), never before the call
            started = time.monotonic()
            await call.read()  # one message, then nothing
            while not servicer.timeouts:
                assert time.monotonic() - started < GRPC_TIMEOUT_S + 20, "no timeout"
                await asyncio.sleep(0.05)
            assert time.monotonic() - started >= GRPC_TIMEOUT_S * 0.9
            received = 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while await call.read() is not grpc.aio.EOF:
                    received += 1
            # CANCELLED naming the setting, not the handler's INTERNAL
            assert e.value.code() == grpc.StatusCode.CANCELLED
            assert e.value.details() == grpc_timeout_details(GRPC_TIMEOUT_S)
            assert "server.stream_idle_timeout_s" in e.value.details()
            assert received == servicer.messages_yielded < GRPC_NUM_MESSAGES
            assert servicer.timeouts == 1
    asyncio.run(main())


def test_a_slow_grpc_reader_is_not_timed_out_and_gets_everything():
    async def main():
        servicer = StreamingServicer()
        async with grpc_stream(servicer, timeout_s=120) as call:
            received = 0
            async for message in call:
                assert message == GRPC_MESSAGE
                received += 1
                await asyncio.sleep(0.005)  # ~2.6 MB/s, far behind what the server writes
            assert received == GRPC_NUM_MESSAGES and servicer.timeouts == 0
    asyncio.run(main())
