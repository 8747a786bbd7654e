"""Runs a synchronous Engine on a dedicated thread and bridges it to an asyncio loop.

The engine (kvmesh.worker.engine.Engine) is single-threaded: only this thread calls it. Requests,
aborts and snapshot requests reach it through a thread-safe command queue; token deltas go back to
each request's asyncio.Queue in one `call_soon_threadsafe` per engine step, so the actor's event
loop never waits on a model step and a step never waits on the event loop. No Ray here: the Serve
worker (worker.py) wraps it.

Liveness is the engine's own: `is_alive()` is false once the engine thread (or process) is gone,
and `stalled_for()` counts how long an engine with requests has gone without finishing a step.
When the engine dies, every open stream gets one `retryable` error delta (nothing went wrong with
the request itself: another worker may run it), later submits get one at once, and the worker is
woken to report the death.
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

from kvmesh.protocol import EngineRequest, KVEventBatch, KVSnapshot, TokenDelta, WorkerLoad

logger = logging.getLogger("kvmesh.cluster")

_IDLE_WAIT_S = 0.05  # how long an idle engine thread blocks for a command


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


def engine_info(engine) -> dict:
    """What the worker tells routers and the ingress about its engine (ModelInfo's fields)."""
    return {"model_name": engine.model_name, "max_model_len": int(engine.max_model_len),
            "block_size": int(engine.block_size), "hash_salt": bytes(engine.hash_salt),
            "eos_token_id": getattr(engine.tokenizer, "eos_token_id", None),
            "vocab_size": int(engine.model_config.vocab_size)}


class EngineLoop:
    """The engine on a thread of this process (engine_process.py has it in a child process)."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, ttft_window_s: float = 30.0):
        self.engine = engine
        self._setup(loop, ttft_window_s, engine.get_load(), engine_info(engine))
        self._commands: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self._thread.start()

    def _setup(self, loop: asyncio.AbstractEventLoop, ttft_window_s: float, load: WorkerLoad,
               info: dict) -> None:
        self.loop = loop
        self.info = info
        self.stats = LoopStats()
        self.ttft_window_s = ttft_window_s
        self._ttfts: deque[tuple[float, float]] = deque()  # (finish-of-first-token time, ttft)
        self._streams: dict[str, asyncio.Queue] = {}  # only touched on the asyncio loop
        self._kv_batches: deque[KVEventBatch] = deque()  # engine side appends, publisher pops
        self.load: WorkerLoad = load
        self.on_progress = None  # callable run on the asyncio loop after each step (publisher wake-up)
        self.last_step_end = time.monotonic()
        self.busy_since: float | None = None  # when the current step started (None: not in a step)
        self.error: BaseException | None = None
        self._stop = threading.Event()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)

    # ---- asyncio side ------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> asyncio.Queue:
        """Queue a request; its TokenDeltas arrive on the returned queue (the last one finished)."""
        out: asyncio.Queue = asyncio.Queue()
        if not self.is_alive():
            out.put_nowait(engine_failed(request.request_id, self.failure_message()))
            return out
        self._streams[request.request_id] = out
        self._send(("add", request))
        return out

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    async def snapshot(self) -> KVSnapshot:
        if not self.is_alive():
            raise RuntimeError(self.failure_message())
        fut = self.loop.create_future()
        self._send(("snapshot", fut))
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
        """Seconds the engine thread has been inside one step (0 when it is not in a step)."""
        now = time.monotonic() if now is None else now
        return 0.0 if self.busy_since is None else now - self.busy_since

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def report(self, stall_timeout_s: float) -> WorkerLoad:
        """The engine's last load with its health and stall judged now, stamped with this moment
        (the worker's load report, which is also its heartbeat)."""
        return dataclasses.replace(self.load, healthy=self.is_alive(), timestamp=time.time(),
                                   stalled=self.stalled_for() > stall_timeout_s)

    def failure_message(self) -> str:
        return f"engine loop died: {self.error!r}"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _deliver(self, deltas: list[TokenDelta], load: WorkerLoad) -> None:
        self.load = load
        now = time.time()
        for d in deltas:
            out = self._streams.get(d.request_id)
            if d.first_token_time is not None and d.num_output_tokens == len(d.token_ids) and d.token_ids:
                self._ttfts.append((now, max(0.0, d.first_token_time - d.arrival_time)))
            if d.finished:
                self._streams.pop(d.request_id, None)
                self.stats.finished += 1
                self.stats.generation_tokens += d.num_output_tokens
                if d.num_output_tokens or d.finish_reason != "error":
                    self.stats.prompt_tokens += d.num_prompt_tokens
                    self.stats.cached_tokens += d.num_cached_tokens
                if d.finish_reason == "error":
                    self.stats.errors += 1
            if out is not None:
                out.put_nowait(d)
        if self.on_progress is not None:
            self.on_progress()

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                deltas = []
                if self.engine.has_unfinished_requests():
                    self.busy_since = time.monotonic()
                    deltas = self.engine.step()
                    self.last_step_end = time.monotonic()
                    self.stats.steps += 1
                    self.stats.step_seconds += self.last_step_end - self.busy_since
                    self.stats.preemptions = self.engine.scheduler.num_preemptions
                    self.busy_since = None
                batch = self.engine.take_kv_events()
                if batch is not None:
                    self._kv_batches.append(batch)
                if deltas or batch is not None:
                    self.loop.call_soon_threadsafe(self._deliver, deltas, self.engine.get_load())
        except BaseException as e:  # the worker's health check reports it; Serve replaces the replica
            logger.exception("kvmesh engine loop died")
            self.error = e
            self.loop.call_soon_threadsafe(self._fail_all)

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, kind: str, arg) -> None:
        if kind == "add":
            try:
                self.engine.add_request(arg)
                self.stats.requests += 1
            except ValueError as e:  # a bad request (prompt too long, ...): that caller only
                self.loop.call_soon_threadsafe(self._deliver, [rejected(arg, e)], self.engine.get_load())
        elif kind == "abort":
            self.engine.abort_request(arg)
        elif kind == "snapshot":
            snap = self.engine.kv_snapshot()
            self.loop.call_soon_threadsafe(_set_result, arg, snap)

    def _fail_all(self) -> None:
        """The engine is gone (runs on the asyncio loop after `error` is set, so a submit after this
        is refused at once): end every stream with a retryable error and report the death now."""
        self.load = dataclasses.replace(self.load, healthy=False)
        message = self.failure_message()
        for request_id, out in list(self._streams.items()):
            out.put_nowait(engine_failed(request_id, message))
        self._streams.clear()
        if self.on_progress is not None:
            self.on_progress()


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


def rejected(request: EngineRequest, error: ValueError) -> TokenDelta:
    """The one delta of a request the engine refused (prompt too long, ...): an error for its caller."""
    return TokenDelta(request.request_id, [], "", finish_reason="error",
                      num_prompt_tokens=len(request.prompt_token_ids),
                      error=f"invalid_request: {error}", arrival_time=request.arrival_time)


def coalesce(delta: TokenDelta, stream: asyncio.Queue) -> TokenDelta:
    """`delta` followed by every delta of its request already waiting in `stream`, as one."""
    while not delta.finished and not stream.empty():
        delta = delta.followed_by(stream.get_nowait())
    return delta


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
