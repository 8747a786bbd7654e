"""uvicorn's HTTP/1.1 protocol (httptools) with bounds on the request head, for every HTTP server
a kvmesh cluster runs (Serve's HTTP proxy through cluster/serve_http_limits.py, the ingress's
direct port through cluster/direct_http.py).

uvicorn's httptools protocol takes a request head of any size (httptools gathers a header value
in memory until it ends: 64 MB headers grew Serve's proxy by 1.3 GB and never released it) and
waits for it forever (a client that sends a header line now and then holds its connection and
buffers). Here:
- a head (request line + headers) longer than `max_header_bytes` gets 431 and the connection is
  closed; the bytes are counted before the parser sees them, so no more than that is held;
- a head not complete `header_timeout_s` after the connection opened (or after the first byte of
  the next request on a kept-alive connection) gets 408 and the connection is closed.
The time between requests on a kept-alive connection is uvicorn's own `timeout_keep_alive`.
"""

from __future__ import annotations

import json
from asyncio import TimerHandle

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._reading_head = True
        self._head_bytes = 0
        self._head_timer: TimerHandle | None = None
        self._start_head_timer()

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Body bytes go to the parser whole; a pipelined request's head that shares a read with
        # the previous body is counted from the next read (one read is at most 256 KiB).
        while data and not self.transport.is_closing():
            if not self._reading_head:
                chunk, data = data, b""
            else:
                room = self.max_header_bytes - self._head_bytes
                if room <= 0:
                    self._refuse(431, "request_headers_too_large",
                                 f"request headers larger than {self.max_header_bytes} bytes "
                                 "(server.max_header_bytes)")
                    return
                chunk, data = data[:room], data[room:]
                self._head_bytes += len(chunk)
            super().data_received(chunk)

    # Parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_head_timer()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True
        self._head_bytes = 0

    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._reading_head and not self.transport.is_closing():
            self._refuse(408, "request_timeout", "request headers not received within "
                         f"{self.header_timeout_s:g} s (server.header_timeout_s)")

    def _refuse(self, status: int, code: str, message: str) -> None:
        """An OpenAI-style error JSON, then close: the rest of the head is never read."""
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": code}}).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head.extend([name, b": ", value, b"\r\n"])
        head.extend([b"content-type: application/json\r\n",
                     b"content-length: " + str(len(body)).encode() + b"\r\n",
                     b"connection: close\r\n\r\n", body])
        self.transport.write(b"".join(head))
        self.transport.close()


def bounded_protocol(max_header_bytes: int, header_timeout_s: float) -> type[BoundedHttpToolsProtocol]:
    """The protocol class with these bounds (uvicorn takes a class, not an instance)."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,),
                {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s})
