"""A `kvmesh serve` process on this machine, started and stopped by its process id: what the
integration tests and `kvmesh bench serve --launch` use.

    with LocalCluster(["--replicas", "2", "--device", "cpu", "--model", "random:tiny-llama"]) as c:
        print(c.http_url, c.grpc_target, c.ray_address)
"""

from __future__ import annotations

import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

READY_LINE = "Ctrl-C stops it."


RAY_WORKER_PORTS_END = 19999  # Ray's default max_worker_port: its workers bind 10002-19999
_handed_out: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; IANA's elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A port on 127.0.0.1 that nothing is bound to now, for a server that binds it later.

    It is chosen between Ray's worker ports and the kernel's ephemeral range, never by bind(0):
    a port from the ephemeral range, released and bound again seconds later by Serve's proxy, can
    meanwhile become the source port of one of the hundreds of connections a starting Ray cluster
    opens (seen in CI: "Failed to bind to address '127.0.0.1:36877'"). A process never gets the
    same port twice."""
    lo, hi = RAY_WORKER_PORTS_END + 1, ephemeral_port_range()[0] - 1
    if hi - lo < 1000:  # an unusual ephemeral range: fall back to the kernel's choice
        lo, hi = 0, 0
    for _ in range(200):
        port = random.randint(lo, hi)  # 0: the kernel's choice
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {lo}-{hi} after 200 tries")


def with_this_source(env: dict[str, str]) -> dict[str, str]:
    """`env` with the source tree this kvmesh was imported from first on PYTHONPATH, when it is
    one (a checkout, not an installed wheel). Ray's worker processes import kvmesh for the worker
    setup hook before they put the driver's folder on sys.path, so without this a checkout other
    than the editable install's (a git worktree) would serve the editable install's code."""
    import kvmesh

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvmesh.__file__)))
    if not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return env
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)}


def loopback_ray_env() -> dict[str, str]:
    """Environment that keeps every Ray listener on 127.0.0.1 (and, in tests, auth off)."""
    env = dict(os.environ)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def token_auth_env(token_path: str) -> dict[str, str]:
    """loopback_ray_env() with Ray token auth left to `kvmesh serve` (which turns it on) and this
    token file, so a test never reads or writes the user's ~/.ray/auth_token."""
    env = loopback_ray_env()
    if env.get("RAY_AUTH_MODE") == "disabled":
        del env["RAY_AUTH_MODE"]
    env.pop("RAY_AUTH_TOKEN", None)
    env["RAY_AUTH_TOKEN_PATH"] = token_path
    return env


def new_token_file() -> str:
    """A fresh random Ray auth token in a file only its owner can read."""
    fd, path = tempfile.mkstemp(prefix="kvmesh-ray-token-")  # created 0600
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


class LocalCluster:
    """ray_auth: run with Ray token auth on, as a user's `kvmesh serve` does (a fresh token in a
    temporary file; `ray_env` is the environment a driver needs to join)."""

    def __init__(self, args: list[str], config: str | None = None, start_timeout_s: float = 180.0,
                 ray_auth: bool = False):
        self.base_args = ([config] if config else []) + list(args)
        self.http_port = self.grpc_port = 0
        self.args: list[str] = []
        self.new_ports()
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log_path = None
        self.ray_address = None
        self.token_path = new_token_file() if ray_auth else None
        self.ray_env = token_auth_env(self.token_path) if ray_auth else loopback_ray_env()

    def new_ports(self) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.args = self.base_args + ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> "LocalCluster":
        """Start and wait for the ready line. A start that failed because one of its two ports
        was taken between free_port() and the bind (another program's listener) is tried once
        more on two new ports."""
        try:
            return self._start()
        except RuntimeError:
            log = self.log()
            if not any(f"Failed to bind to address '127.0.0.1:{p}'" in log
                       for p in (self.http_port, self.grpc_port)):
                raise
        self.new_ports()
        return self._start()

    def _start(self) -> "LocalCluster":
        log = tempfile.NamedTemporaryFile("w+", prefix="kvmesh-serve-", suffix=".log", delete=False)
        self.log_path = log.name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", *self.args], stdout=log,
            stderr=subprocess.STDOUT, env=with_this_source(self.ray_env), start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            text = self.log()
            if READY_LINE in text:
                m = re.search(r"ray:\s+(\S+)", text)
                self.ray_address = m.group(1) if m else None
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvmesh serve exited with {self.proc.returncode}:\n{text[-4000:]}")
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"kvmesh serve not ready after {self.start_timeout_s} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # kvmesh serve shuts Serve and its Ray down
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
                self.proc.wait(10)
        if self.token_path is not None and os.path.exists(self.token_path):
            os.unlink(self.token_path)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
