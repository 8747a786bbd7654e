"""Serve's HTTP and gRPC proxies, and the ingress's direct HTTP port (cluster/direct_http.py),
end a response whose client has stopped reading (`server.stream_idle_timeout_s`).

Why in the proxy: it is the only process on the path that sees a client stop reading. Its uvicorn
`send` waits while the socket's write buffer is full (uvicorn's flow control), so the proxy stops
pulling that stream; but upstream nothing waits: the ingress replica's ASGI `send` is an unbounded
queue in Serve 2.60 (`call_http_entrypoint`), so the ingress keeps reading the worker's stream and
the engine generates to the end, the unsent output piling up in the ingress and the proxy.

`StreamIdleTimeout` (an ASGI middleware around the proxy's app) watches each `send` that waits.
When one has waited `timeout_s` and the client has taken no byte in that time (the bytes not yet
acknowledged by it, in uvicorn's buffer and the kernel's send queue, did not go down), the
connection is reset (its unsent bytes dropped: a plain close would keep them for a client that does
not read). The proxy then sees the client gone and ends the request as it ends
any disconnect: it cancels the replica call, the ingress stream and the worker's generator close,
and the engine aborts the request and frees its KV blocks. A client that reads, however slowly, is
never cut: uvicorn resumes writing only after 48 KiB have drained, which a slow reader may take
longer than `timeout_s` to read, so progress is counted in bytes, not in finished sends.

gRPC (`with_write_deadline`): Serve's gRPC proxy answers a streaming call with an async generator;
gRPC's asyncio server writes each message it yields and takes the next only once the write is
done, and a write waits once gRPC's buffers for the stream are full (the client's HTTP/2 window and
what gRPC holds beyond it). A call whose one message has waited `timeout_s` to be written has its
ingress call cancelled (serve_grpc_cancel.cancel_replica_call), so the engine aborts the request as
for a client's cancel and nothing more is produced for it. Unlike HTTP, the stream itself is not
reset: gRPC's asyncio server has no way to cancel one call, and a status cannot overtake the data
queued before it. What gRPC had accepted stays queued for the client, which gets it, then the
status CANCELLED naming the setting, if it reads again; it is freed when the client reads, closes or its deadline passes. A
stream small enough to fit in gRPC's buffers never waits, so it is never cut: it was all written.

`apply()` (listed in ray_patches.PATCHES) adds the middleware where Serve's proxy assembles its
HTTP options, outermost (after any of RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH), so the `send` it
wraps is uvicorn's own, and wraps the gRPC proxy's streaming handlers. The launcher puts the timeout
in KVMESH_STREAM_IDLE_TIMEOUT_S; unset, it is `server.stream_idle_timeout_s`'s default (a cluster
whose node definitions name only the hook); 0 leaves the proxies as they are.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import struct
import sys
import termios

logger = logging.getLogger("kvmesh.cluster")

TIMEOUT_ENV = "KVMESH_STREAM_IDLE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0  # server.stream_idle_timeout_s's default (tests/unit/test_stream_idle_timeout.py)
# A connection's kernel send buffer (Linux doubles it for its bookkeeping): token streams need far
# less; 128 KiB at a 100 ms round trip still moves 1.3 MB/s to a client that reads.
SEND_BUFFER_BYTES = 128 * 1024


class StreamIdleTimeout:
    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        transport = connection_transport(send)
        cap_send_buffer(transport)

        async def send_with_deadline(message):
            while True:
                unsent = unsent_bytes(transport)
                try:
                    async with asyncio.timeout(self.timeout_s):
                        # uvicorn's send waits only before writing, so a timed-out send wrote nothing
                        return await send(message)
                except TimeoutError:
                    if unsent_bytes(transport) < unsent:
                        continue  # the client read something: a slow reader, not a gone one
                logger.warning("kvmesh: %s %s: the client read nothing for %.1f s; closing the "
                               "connection and aborting the request", scope.get("method"),
                               scope.get("path"), self.timeout_s)
                reset(transport)
                return

        await self.app(scope, receive, send_with_deadline)


def connection_transport(send) -> asyncio.Transport:
    """The connection under uvicorn's `send`: a method of its per-request cycle, which holds it.
    ASGI offers no way to abort a connection; uvicorn is the server of Serve 2.60's HTTP proxy."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        raise RuntimeError("stream_idle_timeout: the HTTP server's send has no transport (not "
                           "uvicorn?); cannot abort a connection whose client stopped reading")
    return transport


def cap_send_buffer(transport: asyncio.Transport) -> None:
    """Fix the connection's kernel send buffer at SEND_BUFFER_BYTES instead of letting Linux grow it
    (up to tcp_wmem's 4 MiB, which it did on loopback): a response to a client that reads nothing
    then fills it and the next send waits, which is what the timeout watches, instead of several
    MiB of it vanishing into the kernel while the engine generates to the end; and such a client
    holds at most that much kernel memory."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:  # not a TCP socket (a test's pipe): nothing to cap
            pass


def reset(transport: asyncio.Transport) -> None:
    """Close with a TCP reset (linger 0), so the kernel drops the unsent bytes too instead of
    keeping them for a client that does not read."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def unsent_bytes(transport: asyncio.Transport) -> int:
    """Bytes written to the connection that the client has not acknowledged: the transport's
    buffer plus, on Linux, the kernel's send queue (TIOCOUTQ)."""
    total = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and hasattr(termios, "TIOCOUTQ"):
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        total += int.from_bytes(queued, sys.byteorder, signed=True)
    return total


def grpc_timeout_details(timeout_s: float) -> str:
    return (f"the client read nothing for {timeout_s:g} s (server.stream_idle_timeout_s): "
            "its request was aborted")


def with_write_deadline(handler, timeout_s: float, on_timeout):
    """A streaming gRPC handler (an async generator function of (request, context)) that calls
    `on_timeout(context)` when one of its messages has waited `timeout_s` to be written. Such a
    call ends with status CANCELLED naming the setting, whatever status or error the handler
    ended with after it (Serve's proxy answers its cancelled replica call with INTERNAL "Request
    ... was cancelled."): the client did nothing wrong but stop reading."""

    async def streaming(request, context):
        import grpc

        loop = asyncio.get_running_loop()
        fired = False

        def timed_out():
            nonlocal fired
            fired = True
            logger.warning("kvmesh: a gRPC stream's client read nothing for %.1f s; aborting its "
                           "request", timeout_s)
            on_timeout(context)

        try:
            async for message in handler(request, context):
                timer = loop.call_later(timeout_s, timed_out)
                try:
                    yield message  # gRPC writes it while this generator waits here
                finally:
                    timer.cancel()
        except Exception:
            if not fired:
                raise
        if fired:
            context.set_code(grpc.StatusCode.CANCELLED)
            context.set_details(grpc_timeout_details(timeout_s))

    return streaming


def apply() -> None:
    timeout_s = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
    if timeout_s <= 0:
        return
    from ray.serve._private import proxy
    from ray.serve._private.proxy_request_response import gRPCStreamingType
    from starlette.middleware import Middleware

    from kvmesh.cluster.serve_grpc_cancel import cancel_replica_call

    serve_configure = proxy.configure_http_middlewares

    def configure_http_middlewares(http_options):
        options = serve_configure(http_options)
        options.middlewares.append(Middleware(StreamIdleTimeout, timeout_s=timeout_s))
        return options

    proxy.configure_http_middlewares = configure_http_middlewares

    serve_factory = proxy.gRPCProxy.service_handler_factory
    streaming = (gRPCStreamingType.UNARY_STREAM, gRPCStreamingType.STREAM_STREAM)

    def service_handler_factory(self, service_method, streaming_type):
        handler = serve_factory(self, service_method, streaming_type)
        if streaming_type not in streaming:
            return handler
        return with_write_deadline(handler, timeout_s, cancel_replica_call)

    proxy.gRPCProxy.service_handler_factory = service_handler_factory
