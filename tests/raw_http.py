"""Raw HTTP/1.1 over a socket on 127.0.0.1, for tests of what a server does with request heads
that an HTTP client library would never send (too large, too slow)."""

from __future__ import annotations

import socket
import time


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def request(method: str = "POST", path: str = "/", headers: dict | None = None,
            body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one response with a content-length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def trickle_until_answered(sock: socket.socket, limit_s: float = 30.0) -> tuple[float, bytes]:
    """Send a request line and then a header line every 0.1 s (never the end of the head) until
    the server answers or closes; returns (seconds from the first byte, what it answered)."""
    started = time.monotonic()
    sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n")
    sock.settimeout(0.1)
    answer, line = b"", 0
    while time.monotonic() - started < limit_s:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            line += 1
            try:
                sock.sendall(f"X-Slow-{line}: 1\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                break
            continue
        except ConnectionResetError:
            break
        answer += chunk
        if not chunk:
            break
    return time.monotonic() - started, answer
