"""What only the child-process transport (cluster/engine_process.py) does: start an engine in its
own interpreter, say why it could not, give up on one that loads too slowly, exit when its
replica goes away, and send its reports from a thread of their own. What it shares with the thread
transport is in test_cluster_engine_loop.py."""

import socket
import threading
import time

import pytest

from kvmesh.cluster.engine_core import Ready
from kvmesh.cluster.engine_process import SEND_QUEUE, EngineProcess, Sender, Start, spawn_engine_process
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


def test_the_childs_sender_queues_reports_while_the_replica_does_not_read_and_keeps_their_order():
    """The engine hands a report to the sender thread and goes on: SEND_QUEUE reports of 1 MB, far
    more than the socket holds, are taken while nobody reads; with SEND_QUEUE unsent (besides the
    one the thread is writing) the engine waits (SERVING.md), until the replica reads; then all
    arrive, in order; once the replica is gone, the engine's next sends raise (its loop then ends,
    as with a direct send)."""
    from multiprocessing.connection import Connection

    a, b = socket.socketpair()
    child, replica = Connection(a.detach()), Connection(b.detach())
    sender = Sender(child)
    payload = b"x" * 1_000_000
    handed_over = []

    def engine():
        for i in range(SEND_QUEUE + 3):
            sender.send((i, payload))
            handed_over.append(i)

    handed = threading.Thread(target=engine)
    handed.start()
    deadline = time.monotonic() + 60  # a send of each to the socket would have blocked at the first few
    while len(handed_over) < SEND_QUEUE and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    # the thread writes one (the socket holds less than a report), SEND_QUEUE wait: the next waits too
    assert handed.is_alive() and SEND_QUEUE <= len(handed_over) <= SEND_QUEUE + 1, len(handed_over)
    assert [replica.recv()[0] for _ in range(SEND_QUEUE + 3)] == list(range(SEND_QUEUE + 3))
    handed.join(timeout=60)
    assert not handed.is_alive() and len(handed_over) == SEND_QUEUE + 3
    replica.close()
    deadline = time.monotonic() + 60
    with pytest.raises(OSError):
        while time.monotonic() < deadline:
            sender.send((-1, payload))
    sender.close()
    child.close()
