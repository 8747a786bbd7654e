"""The engine in a child process of the worker replica, as vLLM's EngineCore process.

In one process the engine thread and the replica's event loop share Python's GIL. At GPU rates the
event loop (Serve's streaming of token deltas, the publisher) holds it most of the time, and every
point where a step waits (a CUDA sync, a pinned copy) costs it up to a switch interval (5 ms) to get
the GIL back: on two H200 replicas a decode step of ~3 ms GPU time took ~50 ms. Here the same
EngineCore loop (engine_core.py) runs in its own interpreter and speaks its typed messages, pickled,
over a socket pair: the replica sends `Start` first, the child answers `Ready` (or `Failed`), then
commands and outputs flow as in a thread.

`EngineProcess` is the transport EngineLoop (engine_loop.py) drives; a reader thread hands it the
child's outputs. The child exits when the replica goes away (its end of the socket closes), so a
killed replica frees its GPU. The child's death is read from the socket: the reader sees EOF (a
SIGKILL, a crash) and reports it as `Failed`.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvmesh.cluster.engine_core import Command, EngineCore, Failed, Ready, Stop
from kvmesh.config import EngineConfig

logger = logging.getLogger("kvmesh.cluster")


@dataclass
class Start:
    """The child's first message: what engine to build."""
    config: EngineConfig
    num_threads: int | None  # torch threads (CPU engines); None: torch's default


class EngineProcess:
    """The transport of an engine in a child process (a socket pair of pickled messages)."""
    name = "engine process"

    def __init__(self, engine_config: EngineConfig, num_threads: int | None = None,
                 start_timeout_s: float = 1800.0):
        parent_sock, child_sock = socket.socketpair()
        self._proc = spawn_engine_process(child_sock)
        self._conn = Connection(parent_sock.detach())
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader: threading.Thread | None = None
        self.send(Start(engine_config, num_threads))
        self.ready = self._receive_ready(start_timeout_s)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _receive_ready(self, timeout_s: float) -> Ready:
        try:
            message = self._conn.recv() if self._conn.poll(timeout_s) else None
        except (EOFError, OSError):
            self._proc.wait(timeout=10)
            raise RuntimeError(f"engine process exited with {self._proc.returncode} while starting "
                               "(its error is in this replica's log)") from None
        if message is None:
            self.stop()
            raise TimeoutError(f"engine process did not load its model in {timeout_s:.0f} s")
        if isinstance(message, Failed):
            self.stop()
            raise RuntimeError(f"engine process failed to start:\n{message.message}")
        return message

    def start(self, receive) -> None:
        self._reader = threading.Thread(target=self._read, args=(receive,), name="kvmesh-engine-reader",
                                        daemon=True)
        self._reader.start()

    def _read(self, receive) -> None:
        try:
            while True:
                output = self._conn.recv()
                receive(output)
                if isinstance(output, Failed):
                    return
        except (EOFError, OSError) as e:  # the engine process is gone (or stop() closed the socket)
            if not self._stopping:
                receive(Failed(f"it exited ({self._proc.poll()}): {e!r}"))

    def send(self, command: Command | Start) -> None:
        try:
            with self._send_lock:
                self._conn.send(command)
        except OSError:  # the child is gone: the reader thread sees it too and fails every stream
            pass

    def is_alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and self._proc.poll() is None

    def exit_status(self) -> str:
        return f"exit status {self._proc.poll()}"

    def stop(self) -> None:
        self._stopping = True
        self.send(Stop())
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._conn.close()


def spawn_engine_process(child_sock: socket.socket) -> subprocess.Popen:
    """Start `python -m kvmesh.cluster.engine_process FD` on the child's end of a socket pair."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cluster.engine_process", str(child_sock.fileno())],
                            pass_fds=(child_sock.fileno(),), env=env)
    child_sock.close()
    return proc


# ---- the child ------------------------------------------------------------------------------------

def main(conn: Connection) -> int:
    """The engine process: build the engine, then run the EngineCore loop on the socket."""
    start: Start = conn.recv()
    try:
        if start.num_threads:
            import torch
            torch.set_num_threads(start.num_threads)
        from kvmesh.worker.engine import Engine
        core = EngineCore(Engine(start.config))
    except BaseException:
        conn.send(Failed(traceback.format_exc()))
        return 1
    conn.send(core.ready())
    try:
        core.run(lambda timeout_s: conn.recv() if conn.poll(timeout_s) else None, conn.send)
        core.engine.close()  # its tensor-parallel ranks, if any
        return 0
    except (EOFError, OSError):  # the replica is gone (the ranks, daemon processes, end with this one)
        return 0
    except BaseException:
        try:
            conn.send(Failed(traceback.format_exc()))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main(Connection(int(sys.argv[1]))))
