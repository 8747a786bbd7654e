"""Bounds on the request head for Serve's HTTP proxy (and any other uvicorn server Serve starts
in this process): Ray Serve 2.60 builds its `uvicorn.Config` in
`ray.serve._private.http_util.start_asgi_http_server` with no header size limit or header-read
timeout and no way to pass either, and uvicorn's httptools protocol has neither (see
cluster/http_protocol.py). Serve leaves `http` at uvicorn's "auto", so the "auto" entry of
uvicorn's protocol table is pointed at the bounded protocol, built from KVMESH_MAX_HEADER_BYTES
and KVMESH_HEADER_TIMEOUT_S (server.max_header_bytes, server.header_timeout_s).
tests/integration/test_http_limits.py checks the 431 and the timeout on Serve's proxy.
"""

from __future__ import annotations

import os

MAX_HEADER_BYTES_ENV = "KVMESH_MAX_HEADER_BYTES"
HEADER_TIMEOUT_ENV = "KVMESH_HEADER_TIMEOUT_S"


# The bounded protocol class uvicorn imports by name ("auto" entry); set by apply().
PROXY_PROTOCOL = None


def apply() -> None:
    global PROXY_PROTOCOL
    from uvicorn import config

    from kvmesh.cluster.http_protocol import (DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES,
                                              bounded_protocol)

    if config.HTTP_PROTOCOLS.get("auto") != "uvicorn.protocols.http.auto:AutoHTTPProtocol":
        raise RuntimeError("kvmesh: uvicorn's protocol table changed; cluster/serve_http_limits.py "
                           "no longer knows what Serve's HTTP proxy runs")
    PROXY_PROTOCOL = bounded_protocol(
        int(os.environ.get(MAX_HEADER_BYTES_ENV, DEFAULT_MAX_HEADER_BYTES)),
        float(os.environ.get(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S)))
    config.HTTP_PROTOCOLS["auto"] = "kvmesh.cluster.serve_http_limits:PROXY_PROTOCOL"
