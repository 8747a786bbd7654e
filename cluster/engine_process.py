"""The engine in a child process of the worker replica, as vLLM's EngineCore.

In one process the engine thread and the replica's event loop share Python's GIL. At GPU rates the
event loop (Serve's streaming of token deltas, the publisher) holds it most of the time, and every
point where a step waits (a CUDA sync, a pinned copy) costs it up to a switch interval (5 ms) to get
the GIL back: on two H200 replicas a decode step of ~3 ms GPU time took ~50 ms. Here the step runs
in its own interpreter and talks to the replica over a socket pair with pickled messages:

    replica -> engine:  ("add", EngineRequest) | ("abort", request_id) | ("snapshot", None) | ("stop", None)
    engine -> replica:  ("ready", info, load) | ("step", deltas, kv_batch, load, step_s, counters)
                        | ("snapshot", KVSnapshot) | ("error", traceback text)

`EngineProcessLoop` keeps EngineLoop's asyncio side (streams, TTFT window, counters) unchanged; a
reader thread turns the child's messages into the same deliveries. The child exits when the replica
goes away (its end of the socket closes), so a killed replica frees its GPU.

The child's liveness is read from the socket, not from the replica: it dies when the reader sees
EOF (a SIGKILL, a crash), and it stalls when it has requests and has sent nothing for a while (a
SIGSTOP, a hung kernel), since a working engine reports every step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection

from kvmesh.cluster.engine_loop import _IDLE_WAIT_S, EngineLoop, _set_result, engine_info, rejected
from kvmesh.protocol import KVSnapshot, TokenDelta

logger = logging.getLogger("kvmesh.cluster")


class EngineProcessLoop(EngineLoop):
    def __init__(self, engine_config, loop: asyncio.AbstractEventLoop, ttft_window_s: float = 30.0,
                 num_threads: int | None = None, start_timeout_s: float = 1800.0):
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cluster.engine_process", str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),), env=env)
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._send_lock = threading.Lock()
        self._send(("config", (engine_config, num_threads)))
        _, info, load = self._receive_ready(start_timeout_s)
        self._setup(loop, ttft_window_s, load, info)
        self._snapshots: deque[asyncio.Future] = deque()
        self._last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._read, name="kvmesh-engine-reader", daemon=True)
        self._thread.start()

    def _receive_ready(self, timeout_s: float) -> tuple:
        try:
            ready = self._conn.poll(timeout_s)
            message = self._conn.recv() if ready else None
        except (EOFError, OSError):
            self._proc.wait(timeout=10)
            raise RuntimeError(f"engine process exited with {self._proc.returncode} while starting "
                               "(its error is in this replica's log)") from None
        if message is None:
            self.stop()
            raise TimeoutError(f"engine process did not load its model in {timeout_s:.0f} s")
        if message[0] == "error":
            self.stop()
            raise RuntimeError(f"engine process failed to start:\n{message[1]}")
        return message

    def _send(self, command: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(command)
        except OSError:  # the child is gone: the reader thread sees it too and fails every stream
            pass

    # ---- asyncio side ------------------------------------------------------------------------

    def submit(self, request):
        if not self._streams:  # the engine was idle: a stall counts from now
            self._last_heard = time.monotonic()
        return super().submit(request)

    async def snapshot(self) -> KVSnapshot:
        if not self.is_alive():
            raise RuntimeError(self.failure_message())
        fut = self.loop.create_future()
        self._snapshots.append(fut)
        self._send(("snapshot", None))
        return await fut

    def _resolve_snapshot(self, snap: KVSnapshot) -> None:
        if self._snapshots:
            _set_result(self._snapshots.popleft(), snap)

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds without a word from an engine that has requests (0 when it has none): a step
        report comes after every step, so this is at least the time since the last step ended."""
        now = time.monotonic() if now is None else now
        return now - self._last_heard if self._streams else 0.0

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._proc.poll() is None and self.error is None

    def failure_message(self) -> str:
        return f"engine process died: {self.error or f'exit status {self._proc.poll()}'!r}"

    def _fail_all(self) -> None:
        super()._fail_all()
        while self._snapshots:
            fut = self._snapshots.popleft()
            if not fut.done():
                fut.set_exception(RuntimeError(self.failure_message()))

    def stop(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
        self._send(("stop", None))
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._conn.close()

    # ---- reader thread -----------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                kind, *payload = self._conn.recv()
                self._last_heard = time.monotonic()
                if kind == "step":
                    deltas, batch, load, step_s, (requests, preemptions) = payload
                    if step_s:
                        self.stats.steps += 1
                        self.stats.step_seconds += step_s
                        self.last_step_end = self._last_heard
                    self.stats.requests, self.stats.preemptions = requests, preemptions
                    if batch is not None:
                        self._kv_batches.append(batch)
                    self.loop.call_soon_threadsafe(self._deliver, deltas, load)
                elif kind == "snapshot":
                    self.loop.call_soon_threadsafe(self._resolve_snapshot, payload[0])
                elif kind == "error":
                    raise RuntimeError(f"engine process failed:\n{payload[0]}")
        except (EOFError, OSError) as e:  # the engine process is gone (or stop() closed the socket)
            self.error = self.error or RuntimeError(f"engine process exited ({self._proc.poll()}): {e!r}")
        except BaseException as e:
            self.error = e
        if self._stop.is_set():  # stopped on purpose
            return
        logger.error("kvmesh engine process: %r", self.error)
        try:
            self.loop.call_soon_threadsafe(self._fail_all)
        except RuntimeError:  # the event loop is closed: nobody is waiting
            pass


# ---- the child ------------------------------------------------------------------------------------

def serve(conn: Connection) -> int:
    """The engine process: build the engine, then step while it has work, between commands."""
    _, (config, num_threads) = conn.recv()
    try:
        if num_threads:
            import torch
            torch.set_num_threads(num_threads)
        from kvmesh.worker.engine import Engine
        engine = Engine(config)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return 1
    conn.send(("ready", engine_info(engine), engine.get_load()))
    accepted = 0
    try:
        while True:
            refused: list[TokenDelta] = []
            if conn.poll(0 if engine.has_unfinished_requests() else _IDLE_WAIT_S):
                while True:
                    kind, arg = conn.recv()
                    if kind == "stop":
                        return 0
                    if kind == "add":
                        try:
                            engine.add_request(arg)
                            accepted += 1
                        except ValueError as e:  # a bad request (prompt too long, ...): that caller only
                            refused.append(rejected(arg, e))
                    elif kind == "abort":
                        engine.abort_request(arg)
                    elif kind == "snapshot":
                        conn.send(("snapshot", engine.kv_snapshot()))
                    if not conn.poll():
                        break
            deltas, step_s = refused, 0.0
            if engine.has_unfinished_requests():
                start = time.monotonic()
                deltas = deltas + engine.step()
                step_s = time.monotonic() - start
            batch = engine.take_kv_events()
            if deltas or batch is not None or step_s:
                conn.send(("step", deltas, batch, engine.get_load(), step_s,
                           (accepted, engine.scheduler.num_preemptions)))
    except (EOFError, OSError):  # the replica is gone
        return 0
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(serve(Connection(int(sys.argv[1]))))
