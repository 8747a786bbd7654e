"""The 64 MB request-head attack of issue 13, measured: starts a local cluster (one CPU replica,
tiny model, an API key), sends 12 requests without the key whose one header is 64 MB, each sent
whole before the answer is read, and prints the HTTP proxy's resident memory after each.

    python bench/http_head_flood.py

With the worker hook's patches (cluster/ray_patches.py) a head is refused after
server.max_header_bytes and the connection closed: the sends fail and memory stays flat.
"""

import socket
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "integration")]

from reliability_support import ray_processes, rss_mb  # noqa: E402

from kvmesh.cluster.local import LocalCluster  # noqa: E402

MB = 1024 * 1024


def send_head(port: int, header_mb: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Fill: ")
            for _ in range(header_mb):
                sock.sendall(b"a" * MB)
            sock.sendall(b"\r\n\r\n")
            return sock.recv(200).split(b"\r\n", 1)[0].decode() or "closed"
        except OSError as e:
            return f"{type(e).__name__} ({e.strerror})"


def main() -> None:
    with LocalCluster(["--replicas", "1", "--device", "cpu", "--model", "random:tiny-llama",
                       "--api-key", "unused"]) as cluster:
        proxy = ray_processes(cluster, "ProxyActor")
        print(f"HTTP proxy RSS before: {rss_mb(proxy):.0f} MB", flush=True)
        for i in range(12):
            try:
                answer = send_head(cluster.http_port, 64)
            except ConnectionRefusedError:
                print(f"{i + 1}: connection refused (the proxy is gone)")
                break
            print(f"{i + 1}: {answer}; proxy RSS {rss_mb(proxy):.0f} MB", flush=True)


if __name__ == "__main__":
    main()
