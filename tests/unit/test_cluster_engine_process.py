"""What only the child-process transport (cluster/engine_process.py) does: start an engine in its
own interpreter, say why it could not, give up on one that loads too slowly, and exit when its
replica goes away. What it shares with the thread transport is in test_cluster_engine_loop.py."""

import socket

import pytest

from kvmesh.cluster.engine_core import Ready
from kvmesh.cluster.engine_process import EngineProcess, Start, spawn_engine_process
from kvmesh.config import EngineConfig

CONFIG = EngineConfig(model="random:tiny-llama", device="cpu", worker_id="w0")


def test_an_engine_process_exits_when_its_replica_goes_away():
    """The child's end of the socket sees EOF when the replica dies (here: the parent end closes)."""
    from multiprocessing.connection import Connection

    parent, child = socket.socketpair()
    proc = spawn_engine_process(child)
    conn = Connection(parent.detach())
    conn.send(Start(CONFIG, 1))
    assert conn.poll(120) and isinstance(conn.recv(), Ready)
    conn.close()
    assert proc.wait(timeout=30) == 0


def test_an_engine_that_cannot_start_says_why():
    with pytest.raises(RuntimeError, match="no-such-preset"):
        EngineProcess(EngineConfig(model="random:no-such-preset", device="cpu"))


def test_an_engine_that_loads_too_slowly_times_out_and_is_stopped():
    import psutil

    def live_children():
        return {p.pid for p in psutil.Process().children()
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}

    before = live_children()
    with pytest.raises(TimeoutError, match="did not load its model"):
        EngineProcess(CONFIG, start_timeout_s=0.01)
    assert live_children() <= before
