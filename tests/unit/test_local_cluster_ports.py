"""cluster/local.py's free_port: the ports it hands to `kvmesh serve` (and to the tests' own
servers) lie outside the kernel's ephemeral range, so no outgoing connection can take one between
the choice and the server's bind, and LocalCluster retries a start whose port was taken anyway."""

import socket
import sys

import pytest

from kvmesh.cluster import local
from kvmesh.cluster.local import LocalCluster, ephemeral_port_range, free_port


def test_free_ports_lie_between_rays_worker_ports_and_the_ephemeral_range():
    lo = ephemeral_port_range()[0]
    ports = [free_port() for _ in range(200)]
    assert all(local.RAY_WORKER_PORTS_END < p < lo for p in ports), ports
    assert len(set(ports)) == len(ports), "a process got the same port twice"


def test_a_port_something_listens_on_is_never_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        tries = []
        real_randint = local.random.randint

        def randint(a, b):  # the listener's port twice, then random ones
            tries.append(a)
            return taken if len(tries) <= 2 else real_randint(a, b)

        monkeypatch.setattr(local.random, "randint", randint)
        assert free_port() != taken
        assert len(tries) >= 3


def test_a_start_that_lost_its_port_is_tried_again_on_new_ports(tmp_path, monkeypatch):
    """The first `kvmesh serve` stands in for one whose proxy could not bind (the message Serve
    prints); the second for one that starts. The stand-ins are real processes started by start()."""
    script = tmp_path / "fake_serve.py"
    marker = tmp_path / "first-done"
    script.write_text(
        "import os, sys, time\n"
        f"marker = {str(marker)!r}\n"
        "port = sys.argv[sys.argv.index('--http-port') + 1]\n"
        "if not os.path.exists(marker):\n"
        "    open(marker, 'w').close()\n"
        "    print(f\"RuntimeError: Failed to bind to address '127.0.0.1:{port}'.\", flush=True)\n"
        "    sys.exit(1)\n"
        "print('ray: 127.0.0.1:1 Ctrl-C stops it.', flush=True)\n"
        "time.sleep(60)\n")
    real_popen = local.subprocess.Popen
    monkeypatch.setattr(local.subprocess, "Popen", lambda cmd, **kw: real_popen(
        [sys.executable, str(script), *cmd[4:]], **kw))
    c = LocalCluster(["--replicas", "1"], start_timeout_s=30)
    first = (c.http_port, c.grpc_port)
    try:
        c.start()
        assert (c.http_port, c.grpc_port) != first
        assert c.args[-4:] == ["--http-port", str(c.http_port), "--grpc-port", str(c.grpc_port)]
    finally:
        c.stop(timeout_s=5)


def test_a_start_that_failed_otherwise_is_not_retried(tmp_path, monkeypatch):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nprint('ValueError: --replicas must be >= 1', flush=True)\nsys.exit(2)\n")
    calls = []
    real_popen = local.subprocess.Popen

    def popen(cmd, **kw):
        calls.append(cmd)
        return real_popen([sys.executable, str(script)], **kw)

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    with pytest.raises(RuntimeError, match="exited with 2"):
        LocalCluster(["--replicas", "0"], start_timeout_s=30).start()
    assert len(calls) == 1
