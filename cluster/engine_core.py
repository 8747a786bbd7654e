"""The one loop that drives an Engine, and the typed messages it speaks (as vLLM's EngineCore).

    replica -> engine:  Submit | Abort | Snapshot | Stop
    engine -> replica:  Ready (once, first) | StepReport (after every step) | SnapshotReply | Failed

The loop is the same wherever the engine runs; only the transport differs: a thread of the replica
with a queue.Queue (engine_loop.EngineThread) or a child process with a socket pair
(engine_process.EngineProcess). Every message is a plain dataclass, so both carry the same objects.

A StepReport comes after every step (an engine with requests always steps), so a replica that hears
nothing from an engine with requests for a while knows it is stalled (engine_loop.EngineLoop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.cluster.messages import ModelInfo
from kvmesh.protocol import EngineRequest, KVEventBatch, KVSnapshot, TokenDelta, WorkerLoad

IDLE_WAIT_S = 0.05  # how long an idle engine blocks for a command


# ---- replica -> engine ----------------------------------------------------------------------------

@dataclass
class Submit:
    request: EngineRequest


@dataclass
class Abort:
    request_id: str


@dataclass
class Snapshot:
    """Ask for a KVSnapshot (answered by a SnapshotReply, in order with the step reports)."""


@dataclass
class Stop:
    """End the loop (the replica is shutting down)."""


Command = Submit | Abort | Snapshot | Stop


# ---- engine -> replica ----------------------------------------------------------------------------

@dataclass
class Ready:
    info: ModelInfo
    load: WorkerLoad


@dataclass
class StepReport:
    deltas: list[TokenDelta]  # this step's, and those of requests refused since the last step
    kv_batch: KVEventBatch | None
    load: WorkerLoad
    step_seconds: float  # wall time inside Engine.step (0: no step ran, only refusals or events)
    num_requests: int  # requests accepted since start
    num_preemptions: int  # since start


@dataclass
class SnapshotReply:
    snapshot: KVSnapshot


@dataclass
class Failed:
    """The engine died (its loop raised); `message` says why (a traceback from a child process)."""
    message: str


Output = Ready | StepReport | SnapshotReply | Failed


def model_info(engine) -> ModelInfo:
    """What the worker tells routers and the ingress about its engine."""
    return ModelInfo(engine.model_name, int(engine.max_model_len), int(engine.block_size),
                     bytes(engine.hash_salt), getattr(engine.tokenizer, "eos_token_id", None),
                     int(engine.model_config.vocab_size))


def rejected(request: EngineRequest, error: ValueError) -> TokenDelta:
    """The one delta of a request the engine refused (prompt too long, ...): an error for its caller."""
    return TokenDelta(request.request_id, [], "", finish_reason="error",
                      num_prompt_tokens=len(request.prompt_token_ids),
                      error=f"invalid_request: {error}", arrival_time=request.arrival_time)


class EngineCore:
    """Owns one Engine: applies commands between steps, steps while it has work, reports each step.
    Single-threaded: only the thread that calls `run` touches the engine."""

    def __init__(self, engine):
        self.engine = engine
        self.num_requests = 0

    def ready(self) -> Ready:
        return Ready(model_info(self.engine), self.engine.get_load())

    def run(self, next_command: Callable[[float], Command | None], emit: Callable[[Output], None]) -> None:
        """Until a Stop: take every waiting command, then step. `next_command(timeout_s)` returns
        the next command, or None once `timeout_s` passed without one; an idle engine waits for one
        (IDLE_WAIT_S at a time), a busy one does not wait. `emit` sends an output to the replica."""
        while True:
            refused: list[TokenDelta] = []
            command = next_command(0.0 if self.engine.has_unfinished_requests() else IDLE_WAIT_S)
            while command is not None:
                if isinstance(command, Stop):
                    return
                self._apply(command, refused, emit)
                command = next_command(0.0)
            report = self._step(refused)
            if report is not None:
                emit(report)

    def _apply(self, command: Command, refused: list[TokenDelta], emit) -> None:
        if isinstance(command, Submit):
            try:
                self.engine.add_request(command.request)
                self.num_requests += 1
            except ValueError as e:  # a bad request (prompt too long, ...): that caller only
                refused.append(rejected(command.request, e))
        elif isinstance(command, Abort):
            self.engine.abort_request(command.request_id)
        elif isinstance(command, Snapshot):
            emit(SnapshotReply(self.engine.kv_snapshot()))
        else:
            raise TypeError(f"not an engine command: {command!r}")

    def _step(self, refused: list[TokenDelta]) -> StepReport | None:
        engine = self.engine
        deltas, step_seconds = refused, 0.0
        if engine.has_unfinished_requests():
            start = time.monotonic()
            deltas = deltas + engine.step()
            step_seconds = time.monotonic() - start
        batch = engine.take_kv_events()
        if not (deltas or batch is not None or step_seconds):
            return None
        return StepReport(deltas, batch, engine.get_load(), step_seconds, self.num_requests,
                          engine.scheduler.num_preemptions)
