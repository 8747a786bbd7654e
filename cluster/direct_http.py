"""The ingress's own HTTP server (`server.direct_http_port`): each ingress replica serves the same
FastAPI app with uvicorn on one shared port (SO_REUSEPORT: the kernel spreads connections across
the replicas of a node), so a request and its streamed chunks skip Serve's HTTP proxy, a hop that
costs as much CPU per chunk as the ingress itself (docs/PERF.md "Serving cluster"). Serve's proxy
port keeps serving the same app beside it.

It has the request-head bounds of Serve's proxy (cluster/http_protocol.py) and its stream idle
timeout (cluster/stream_idle_timeout.py's middleware around the app).

The routes are the Ingress class's methods; Serve's class-based view finds the instance through the
replica context, which this process has, so they run unchanged.
"""

from __future__ import annotations

import logging
import socket

logger = logging.getLogger("kvmesh.cluster")


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that the node's other ingress replicas share; a port held
    by anything else is a clear error naming the field."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"server.direct_http_port: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.setblocking(False)
    return sock


async def serve_direct(app, sock: socket.socket, server) -> None:
    """Serve `app` on `sock` until the replica's event loop ends, with the request-head bounds
    and keep-alive time of `server` (the config's ServerSection; cluster/http_protocol.py)."""
    import uvicorn

    from kvmesh.cluster.http_protocol import bounded_protocol

    if server.stream_idle_timeout_s > 0:
        from kvmesh.cluster.stream_idle_timeout import StreamIdleTimeout

        app = StreamIdleTimeout(app, server.stream_idle_timeout_s)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            http=bounded_protocol(server.max_header_bytes, server.header_timeout_s),
                            timeout_keep_alive=server.keep_alive_timeout_s)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # the replica's process owns its signals
    try:
        await server.serve(sockets=[sock])
    except Exception:
        logger.exception("kvmesh ingress: the direct HTTP server on %s stopped", sock.getsockname())
