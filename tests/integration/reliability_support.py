"""Helpers of the reliability tests: HTTP calls that return (status, json, headers) whatever the
status, /metrics as a dict, the cluster's Ray processes by role, and a bounded wait."""

from __future__ import annotations

import json
import re
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
    root = psutil.Process(cluster.proc.pid)
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


def worker_pids(cluster) -> dict[str, int]:
    """Worker replica id -> process id, read from Serve's request log lines in the cluster's log
    ("(ServeReplica:<app>:KVWorker pid=N) ... <app>_KVWorker <replica id> ..."): only replicas
    that have served a request appear."""
    out = {}
    for m in re.finditer(r"ServeReplica:\w+:KVWorker pid=(\d+)\)\S*\s+\w+ [\d\-: ,]+ \w+_KVWorker (\w+) ",
                         cluster.log()):
        out[m.group(2)] = int(m.group(1))
    return out
