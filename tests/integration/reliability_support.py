"""Helpers of the reliability tests: HTTP calls that return (status, json, headers) whatever the
status, /metrics as a dict, the cluster's Ray processes by role, and a bounded wait."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request

import psutil

from kvmesh.bench.soak import scrape


def http(url: str, body=None, headers: dict | None = None, timeout: float = 120,
         method: str | None = None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data, h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read()
            status, hdrs = resp.status, resp.headers
    except urllib.error.HTTPError as e:
        text, status, hdrs = e.read(), e.code, e.headers
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = {"raw": text.decode(errors="replace")}
    return status, parsed, hdrs


def metrics(base_url: str, headers: dict | None = None) -> dict[str, float]:
    return scrape(base_url, headers=headers, timeout_s=30)


def per_worker(values: dict[str, float], name: str) -> dict[str, float]:
    return {re.search(r'worker="([^"]+)"', k).group(1): v
            for k, v in values.items() if k.startswith(name + "{")}


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2, what: str = "condition"):
    """Poll `predicate` (returns a truthy value when done) until it holds or the time is up."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what} did not hold within {timeout_s} s (last: {last!r})")


def ray_processes(cluster, role: str) -> list[psutil.Process]:
    """The cluster's Ray worker processes whose title names `role` (e.g. "Ingress", "KVWorker"),
    found below the `kvmesh serve` process (its own session), never by a global name search."""
    return ray_processes_below(cluster.proc.pid, role)


def ray_processes_below(pid: int, role: str) -> list[psutil.Process]:
    """The Ray worker processes below process `pid` whose title names `role`."""
    root = psutil.Process(pid)
    out = []
    for p in root.children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::") and role in title:
            out.append(p)
    return out


def rss_mb(processes) -> float:
    total = 0
    for p in processes:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


class ReplicaProcesses:
    """A worker replica's actor process and its engine process (cluster/engine_process.py),
    signalled together: a slow or stalled replica is slow in both."""

    def __init__(self, pid: int):
        actor = psutil.Process(pid)
        self.procs = [actor] + actor.children(recursive=True)

    def send_signal(self, sig) -> None:
        for p in self.procs:
            p.send_signal(sig)


def engine_process_of(actor_pid: int) -> psutil.Process:
    """The engine child (cluster/engine_process.py) of a worker replica's actor process."""
    engines = [p for p in psutil.Process(actor_pid).children()
               if "kvmesh.cluster.engine_process" in " ".join(p.cmdline())]
    assert len(engines) == 1, engines
    return engines[0]


_WORKER_PIDS = """
import os, sys, ray
ray.init(address=sys.argv[1], namespace="serve", logging_level="ERROR")
for a in ray.util.list_named_actors(all_namespaces=True):
    if "#KVWorker#" in a["name"]:
        actor = ray.get_actor(a["name"], namespace=a["namespace"])
        print(a["name"].rsplit("#", 1)[1], ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))
"""


def worker_pids(cluster) -> dict[str, int]:
    """Worker replica id -> process id, asked of each replica actor by a driver in a separate
    process (Ray reads its loopback setting at import, and this test process may have imported it
    already). Not from Serve's request log lines: its throughput-optimized mode keeps them off stderr."""
    import subprocess
    import sys

    from kvmesh.cluster.local import loopback_ray_env

    done = subprocess.run([sys.executable, "-c", _WORKER_PIDS, cluster.ray_address], capture_output=True,
                          text=True, env=loopback_ray_env(), timeout=120, check=True)
    return {rid: int(pid) for rid, pid in (line.split() for line in done.stdout.splitlines() if line.strip())}


def chat_stream_body(model: str, max_tokens: int) -> dict:
    """A streaming chat request whose chunks are large (20 top logprobs: ~1.6 KB a token), so a
    tiny model's output outgrows socket buffers in seconds."""
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "top_logprobs": 20}


def open_raw_stream(port: int, path: str, body: dict, rcvbuf: int) -> tuple[socket.socket, bytes]:
    """POST `body` over a raw socket to 127.0.0.1:port; returns the socket and its first read (the
    response head). The socket advertises an Ethernet MSS (1448): on loopback's 64 KiB MSS Linux
    gives the server's socket a ~4 MiB send buffer, which would hide a client that stopped reading
    for minutes."""
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1448)
    s.settimeout(120)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data)
    return s, s.recv(1024)


# A gRPC client that advertises a small HTTP/2 window and no window growth (BDP probing off): the
# server's writes to it wait after ~16 KiB plus what gRPC queues (measured on grpc.aio alone: 236
# messages of 100 bytes), instead of the ~6 MiB gRPC's default window grows to on loopback, which
# the tiny model's whole stream fits in (docs/RELIABILITY.md "Backpressure").
SMALL_WINDOW_OPTIONS = [("grpc.http2.lookahead_bytes", 16384), ("grpc.http2.bdp_probe", 0)]


def read_on(stream) -> tuple[list, tuple | None]:
    """The rest of a gRPC response stream: its messages, and how the call ended ((code, details)
    of its error status; None when it ended OK)."""
    import grpc

    messages = []
    try:
        for message in stream:
            messages.append(message)
    except grpc.RpcError as e:
        return messages, (e.code(), e.details())
    return messages, None
