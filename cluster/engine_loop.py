"""The replica's side of its engine: streams, counters and liveness over a transport to an EngineCore.

The engine (engine_core.EngineCore around kvmesh.worker.engine.Engine) runs behind one of two
transports: a thread of this process (`EngineThread`, here) or a child process (`EngineProcess`,
engine_process.py). Either one calls `EngineLoop`'s receiver from its own thread; token deltas go
to each request's asyncio.Queue in one `call_soon_threadsafe` per engine step, so the actor's event
loop never waits on a model step and a step never waits on the event loop. No Ray here: the Serve
worker (worker.py) wraps it.

Liveness is read from the transport, the same way in both modes: the engine is dead once its
thread or process is gone (a `Failed` report, or the process's socket closing), and it is stalled
when it has requests and has reported nothing for a while (a hung step, a SIGSTOPped process),
since a working engine reports every step. When the engine dies, every open stream gets one
`retryable` error delta (nothing went wrong with the request itself: another worker may run it),
later submits get one at once, and the worker is woken to report the death.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvmesh.cluster.engine_core import (Abort, Command, EngineCore, Failed, Output, Ready, Snapshot,
                                        SnapshotReply, StepReport, Stop, Submit)
from kvmesh.protocol import EngineRequest, KVEventBatch, KVSnapshot, TokenDelta, WorkerLoad

logger = logging.getLogger("kvmesh.cluster")


@dataclass
class LoopStats:
    """Counters since start (read by the worker for metrics and autoscaling)."""
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    errors: int = 0
    steps: int = 0
    step_seconds: float = 0.0  # wall time inside Engine.step (its mean shows host-side contention)
    preemptions: int = 0


class Transport(Protocol):
    """Carries commands to an EngineCore and its outputs back (EngineThread, EngineProcess)."""
    name: str  # "engine thread" / "engine process", in failure messages
    ready: Ready  # the engine's first report, received before the transport is handed over

    def start(self, receive) -> None:
        """Begin calling `receive(output)` with every later output, from a thread of its own."""

    def send(self, command: Command) -> None: ...

    def is_alive(self) -> bool: ...

    def exit_status(self) -> str:
        """How the engine ended, for a failure message when no Failed report said why."""

    def stop(self) -> None: ...


class EngineLoop:
    def __init__(self, transport: Transport, loop: asyncio.AbstractEventLoop, ttft_window_s: float = 30.0):
        self.transport = transport
        self.loop = loop
        self.info = transport.ready.info
        self.load: WorkerLoad = transport.ready.load
        self.stats = LoopStats()
        self.ttft_window_s = ttft_window_s
        self._ttfts: deque[tuple[float, float]] = deque()  # (finish-of-first-token time, ttft)
        self._streams: dict[str, asyncio.Queue] = {}  # only touched on the asyncio loop
        self._snapshots: deque[asyncio.Future] = deque()  # answered in order
        self._kv_batches: deque[KVEventBatch] = deque()  # the transport appends, the publisher pops
        self._last_heard = time.monotonic()
        self.on_progress = None  # callable run on the asyncio loop after each step (publisher wake-up)
        self.error: str | None = None  # why the engine died (set by its Failed report)
        transport.start(self._receive)

    # ---- asyncio side ------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> asyncio.Queue:
        """Queue a request; its TokenDeltas arrive on the returned queue (the last one finished)."""
        out: asyncio.Queue = asyncio.Queue()
        if not self.is_alive():
            out.put_nowait(engine_failed(request.request_id, self.failure_message()))
            return out
        if not self._streams:  # the engine was idle: a stall counts from now
            self._last_heard = time.monotonic()
        self._streams[request.request_id] = out
        self.transport.send(Submit(request))
        return out

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.transport.send(Abort(request_id))

    async def snapshot(self) -> KVSnapshot:
        if not self.is_alive():
            raise RuntimeError(self.failure_message())
        fut = self.loop.create_future()
        self._snapshots.append(fut)
        self.transport.send(Snapshot())
        return await fut

    def take_kv_batches(self) -> list[KVEventBatch]:
        out = []
        while self._kv_batches:
            out.append(self._kv_batches.popleft())
        return out

    def ttft_p90(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        while self._ttfts and now - self._ttfts[0][0] > self.ttft_window_s:
            self._ttfts.popleft()
        if not self._ttfts:
            return 0.0
        values = sorted(t for _, t in self._ttfts)
        return values[min(len(values) - 1, int(0.9 * len(values)))]

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds without a word from an engine that has requests (0 when it has none): a step
        report comes after every step, so this is at least the time since the last step ended."""
        now = time.monotonic() if now is None else now
        return now - self._last_heard if self._streams else 0.0

    def is_alive(self) -> bool:
        return self.error is None and self.transport.is_alive()

    def report(self, stall_timeout_s: float) -> WorkerLoad:
        """The engine's last load with its health and stall judged now, stamped with this moment
        (the worker's load report, which is also its heartbeat)."""
        return dataclasses.replace(self.load, healthy=self.is_alive(), timestamp=time.time(),
                                   stalled=self.stalled_for() > stall_timeout_s)

    def failure_message(self) -> str:
        return f"{self.transport.name} died: {self.error or self.transport.exit_status()}"

    def stop(self) -> None:
        self.transport.stop()

    def _deliver(self, deltas: list[TokenDelta], load: WorkerLoad) -> None:
        self.load = load
        now = time.time()
        for d in deltas:
            out = self._streams.get(d.request_id)
            if d.first_token_time is not None and d.num_output_tokens == len(d.token_ids) and d.token_ids:
                self._ttfts.append((now, max(0.0, d.first_token_time - d.arrival_time)))
            if d.finish_reason is not None:  # a sequence's end (n > 1: each of them)
                self.stats.generation_tokens += d.num_output_tokens
            if d.finished:
                self._streams.pop(d.request_id, None)
                self.stats.finished += 1
                if d.num_output_tokens or d.finish_reason != "error":
                    self.stats.prompt_tokens += d.num_prompt_tokens
                    self.stats.cached_tokens += d.num_cached_tokens
                if d.finish_reason == "error":
                    self.stats.errors += 1
            if out is not None:
                out.put_nowait(d)
        if self.on_progress is not None:
            self.on_progress()

    def _resolve_snapshot(self, snapshot: KVSnapshot) -> None:
        if self._snapshots:
            fut = self._snapshots.popleft()
            if not fut.done():
                fut.set_result(snapshot)

    def _fail_all(self) -> None:
        """The engine is gone (runs on the asyncio loop after `error` is set, so a submit after this
        is refused at once): end every stream with a retryable error and report the death now."""
        self.load = dataclasses.replace(self.load, healthy=False)
        message = self.failure_message()
        for request_id, out in list(self._streams.items()):
            out.put_nowait(engine_failed(request_id, message))
        self._streams.clear()
        while self._snapshots:
            fut = self._snapshots.popleft()
            if not fut.done():
                fut.set_exception(RuntimeError(message))
        if self.on_progress is not None:
            self.on_progress()

    # ---- the transport's thread --------------------------------------------------------------

    def _receive(self, output: Output) -> None:
        self._last_heard = time.monotonic()
        if isinstance(output, StepReport):
            if output.step_seconds:
                self.stats.steps += 1
                self.stats.step_seconds += output.step_seconds
            self.stats.requests, self.stats.preemptions = output.num_requests, output.num_preemptions
            if output.kv_batch is not None:
                self._kv_batches.append(output.kv_batch)
            self._call_soon(self._deliver, output.deltas, output.load)
        elif isinstance(output, SnapshotReply):
            self._call_soon(self._resolve_snapshot, output.snapshot)
        elif isinstance(output, Failed):
            self.error = self.error or output.message
            logger.error("kvmesh %s died: %s", self.transport.name, output.message)
            self._call_soon(self._fail_all)

    def _call_soon(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting
            pass


class EngineThread:
    """The transport of an engine on a thread of this process (a queue.Queue of commands)."""
    name = "engine thread"

    def __init__(self, engine):
        self.core = EngineCore(engine)
        self.ready = self.core.ready()
        self._commands: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, receive) -> None:
        self._thread = threading.Thread(target=self._run, args=(receive,), name="kvmesh-engine", daemon=True)
        self._thread.start()

    def _run(self, receive) -> None:
        try:
            self.core.run(self._next_command, receive)
            self.core.engine.close()  # its tensor-parallel ranks, if any
        except BaseException as e:  # the worker's health check reports it; Serve replaces the replica
            logger.exception("kvmesh engine thread died")
            receive(Failed(repr(e)))

    def _next_command(self, timeout_s: float) -> Command | None:
        try:
            return self._commands.get(timeout=timeout_s) if timeout_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return None

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def exit_status(self) -> str:
        return "its thread ended"

    def stop(self) -> None:
        self.send(Stop())
        if self._thread is not None:
            self._thread.join(timeout=10)


class EngineUnavailable(RuntimeError):
    """Raised by a worker's generate for a request its engine could not finish because the engine
    died: the ingress runs it again on another worker (`worker_id`: not that one)."""

    def __init__(self, worker_id: str, message: str):
        super().__init__(worker_id, message)
        self.worker_id, self.message = worker_id, message

    def __str__(self) -> str:
        return f"worker {self.worker_id}: {self.message}"


def engine_failed(request_id: str, message: str) -> TokenDelta:
    """The last delta of a request whose engine died: retryable on another worker."""
    return TokenDelta(request_id, [], "", finish_reason="error", error=message, retryable=True)


def coalesce(delta: TokenDelta, stream: asyncio.Queue) -> TokenDelta:
    """`delta` followed by every delta of its request already waiting in `stream`, as one."""
    while not delta.finished and not stream.empty():
        delta = delta.followed_by(stream.get_nowait())
    return delta
