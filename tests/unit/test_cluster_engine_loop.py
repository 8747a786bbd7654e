"""The worker's engine loop: a real Engine (tiny random model) driven by the one EngineCore loop,
in both transports the worker uses (a thread of the replica, a child process), through the same
EngineLoop: streams, aborts, refusals, snapshots, KV event batches, load, TTFT and counters; a dead
engine fails its streams retryably and reports unhealthy; a frozen one is reported stalled until it
steps again. Only how the fault is made differs between the modes."""

import asyncio
import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time

import pytest

from kvmesh.cluster.engine_loop import EngineLoop, EngineThread, coalesce
from kvmesh.cluster.engine_process import EngineProcess
from kvmesh.config import EngineConfig
from kvmesh.protocol import EngineRequest, KVSnapshot
from kvmesh.sampling_params import SamplingParams

from engine_loop_support import drain, run_within  # tests/unit

CONFIG = EngineConfig(model="random:tiny-llama", device="cpu", worker_id="w0")
MODES = ["thread", "process"]
run = functools.partial(run_within, timeout_s=120)
STALL_S = 1.0  # the stall timeout these tests judge by
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ENDLESS = SamplingParams(max_tokens=100_000, ignore_eos=True)


def open_loop(mode: str, event_loop) -> EngineLoop:
    from kvmesh.worker.engine import Engine

    transport = EngineThread(Engine(CONFIG)) if mode == "thread" else EngineProcess(CONFIG, num_threads=1)
    return EngineLoop(transport, event_loop)


def run_with_loop(mode: str, body):
    """`await body(loop)` on a fresh event loop, with an EngineLoop of that mode stopped afterwards."""
    async def main():
        loop = open_loop(mode, asyncio.get_running_loop())
        try:
            return await body(loop)
        finally:
            loop.stop()
    return run(main())


def kill_engine(loop: EngineLoop) -> None:
    """The engine dies: its process is SIGKILLed, or its thread's next step raises (a CUDA error)."""
    if isinstance(loop.transport, EngineProcess):
        os.kill(loop.transport.pid, signal.SIGKILL)
    else:
        loop.transport.core.engine.step = _failing_step


def _failing_step():
    raise RuntimeError("injected engine failure")


@contextlib.contextmanager
def engine_frozen(loop: EngineLoop):
    """The engine makes no progress inside the block (its process SIGSTOPped, or its thread's next
    step hung), then goes on."""
    if isinstance(loop.transport, EngineProcess):
        os.kill(loop.transport.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(loop.transport.pid, signal.SIGCONT)
        return
    engine = loop.transport.core.engine
    real_step, gate = engine.step, threading.Event()

    def hung_step():
        gate.wait()
        return real_step()

    engine.step = hung_step
    try:
        yield
    finally:
        engine.step = real_step
        gate.set()


@pytest.fixture(scope="module")
def reference_tokens():
    """The greedy tokens of the test prompt from an Engine stepped directly."""
    from kvmesh.worker.engine import Engine

    engine = Engine(CONFIG)
    engine.add_request(EngineRequest("ref", list(range(40)), GREEDY))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() for t in d.token_ids]
    return tokens


@pytest.mark.parametrize("mode", MODES)
def test_streams_refuses_aborts_snapshots_and_counts(mode, reference_tokens):
    async def body(loop):
        assert loop.info.model_name and loop.info.block_size == 16 and loop.info.vocab_size == 512
        deltas = await drain(loop.submit(EngineRequest("r1", list(range(40)), GREEDY)))
        assert deltas[-1].finish_reason == "length"
        assert [t for d in deltas for t in d.token_ids] == reference_tokens and len(reference_tokens) == 6
        batches = loop.take_kv_batches()
        assert batches and [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))
        snap = await loop.snapshot()
        assert isinstance(snap, KVSnapshot) and snap.seq == batches[-1].seq and len(snap.block_hashes) >= 2
        assert loop.ttft_p90() > 0.0 and loop.stats.prompt_tokens == 40

        bad = await drain(loop.submit(EngineRequest("bad", list(range(10)) * 300, GREEDY)))
        assert len(bad) == 1 and bad[0].finish_reason == "error" and not bad[0].retryable
        assert bad[0].error.startswith("invalid_request: the prompt is 3000 tokens; the limit is ")

        long = loop.submit(EngineRequest("long", list(range(20)), ENDLESS))
        assert not (await long.get()).finished
        loop.abort("long")
        assert loop.num_streams == 0
        while loop.load.running or loop.load.waiting:  # the engine reports the abort within a step or two
            await asyncio.sleep(0.01)
        assert loop.load.kv_total_blocks > 0 and loop.load.kv_free_blocks > 0
        assert loop.stats.steps > 0 and loop.stats.step_seconds > 0
        # finished: r1, bad and the aborted long
        assert loop.stats.requests == 2 and loop.stats.errors == 1 and loop.stats.finished == 3
        assert loop.is_alive() and loop.stalled_for() == 0.0 and loop.report(STALL_S).healthy
    run_with_loop(mode, body)


@pytest.mark.parametrize("mode", MODES)
def test_a_dead_engine_fails_its_streams_retryably_and_reports_unhealthy_at_once(mode):
    async def body(loop):
        wake_ups = []  # the engine's liveness at each wake-up of the worker's publisher
        loop.on_progress = lambda: wake_ups.append(loop.is_alive())
        out = loop.submit(EngineRequest("r", list(range(20)), ENDLESS))
        await out.get()
        assert loop.report(STALL_S).healthy
        kill_engine(loop)
        last = (await drain(out))[-1]
        # the request is not at fault: marked for another worker to run it
        assert last.finish_reason == "error" and last.retryable
        assert last.error.startswith(f"engine {mode} died: ")
        assert not loop.is_alive()
        assert wake_ups[-1] is False  # ... and the worker was woken to publish the death
        assert not loop.report(STALL_S).healthy and not loop.load.healthy
        # a request sent to the dead engine is refused at once, retryably; so is a snapshot
        refused = await drain(loop.submit(EngineRequest("late", [1, 2, 3], SamplingParams(max_tokens=2))))
        assert len(refused) == 1 and refused[0].retryable and refused[0].finish_reason == "error"
        with pytest.raises(RuntimeError, match=f"engine {mode} died"):
            await loop.snapshot()
    run_with_loop(mode, body)


@pytest.mark.parametrize("mode", MODES)
def test_a_frozen_engine_is_reported_stalled_after_the_timeout_and_recovers_when_it_steps(mode):
    async def body(loop):
        out = loop.submit(EngineRequest("r", list(range(20)), ENDLESS))
        await out.get()
        with engine_frozen(loop):
            frozen = time.monotonic()
            while not loop.report(STALL_S).stalled:  # bounded by the test's timeout
                await asyncio.sleep(0.05)
            assert time.monotonic() - frozen >= STALL_S - 0.2  # not before the timeout
            assert loop.is_alive() and loop.report(STALL_S).healthy  # stalled, not dead
            while not out.empty():  # what it sent before it froze
                out.get_nowait()
        await out.get()  # it steps again
        assert not loop.report(STALL_S).stalled and loop.stalled_for() < STALL_S
        loop.abort("r")
    run_with_loop(mode, body)


def test_a_consumer_that_fell_behind_gets_what_is_waiting_as_one_delta():
    """The worker sends one stream item per read: every delta already queued, merged in order."""
    async def body(loop):
        params = dataclasses.replace(GREEDY, logprobs=1)
        return await drain(loop.submit(EngineRequest("late", list(range(30)), params)))

    deltas = run_with_loop("thread", body)
    assert len(deltas) >= 2
    backlog = asyncio.Queue()
    for d in deltas[1:]:
        backlog.put_nowait(d)
    merged = coalesce(deltas[0], backlog)
    assert backlog.empty() and merged.finish_reason == "length"
    assert merged.token_ids == [t for d in deltas for t in d.token_ids] and len(merged.token_ids) == 6
    assert merged.text == "".join(d.text for d in deltas)
    assert merged.logprobs == [lp for d in deltas for lp in d.logprobs] and len(merged.logprobs) == 6
    assert merged.num_output_tokens == 6 and merged.num_prompt_tokens == 30
    assert merged.first_token_time == deltas[0].first_token_time is not None
    # a finished delta takes nothing after it; another request's delta cannot be merged in
    tail = asyncio.Queue()
    tail.put_nowait(deltas[0])
    assert coalesce(merged, tail) is merged and tail.qsize() == 1
    with pytest.raises(ValueError, match="request_id"):
        deltas[0].followed_by(dataclasses.replace(deltas[1], request_id="other"))


@pytest.mark.parametrize("mode", MODES)
def test_an_n3_request_streams_every_sequence_and_counts_their_tokens(mode):
    """Parallel sampling through the transports: one stream carries the three sequences' deltas
    (by index); it ends with the last sequence, and every sequence's tokens are counted."""
    async def body(loop):
        params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
        deltas = await drain(loop.submit(EngineRequest("g", list(range(10)), params)))
        tokens = {i: sum(len(d.token_ids) for d in deltas if d.index == i) for i in range(3)}
        assert tokens == {0: 5, 1: 5, 2: 5}
        assert sorted(d.index for d in deltas if d.finish_reason) == [0, 1, 2]
        assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
        assert loop.stats.generation_tokens == 15 and loop.stats.finished == 1
        assert loop.num_streams == 0
    run_with_loop(mode, body)


@pytest.mark.parametrize("mode", MODES)
def test_structured_outputs_cross_the_transport_and_compile_on_the_engine_side(mode):
    """The spec travels as plain data (pickled to a child process); the engine compiles it off
    its step and masks the row; one that does not compile ends its request as an invalid one."""
    from kvmesh.structured_outputs import StructuredOutputs

    async def body(loop):
        choice = SamplingParams(max_tokens=20, temperature=1.0, seed=5,
                                structured_outputs=StructuredOutputs(choice=["alpha", "beta"]))
        plain = loop.submit(EngineRequest("plain", list(range(30)), GREEDY))
        deltas = await drain(loop.submit(EngineRequest("c", list(range(40)), choice)))
        assert "".join(d.text for d in deltas) in ("alpha", "beta")
        assert deltas[-1].finish_reason == "stop"
        assert (await drain(plain))[-1].finish_reason == "length"
        bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="(a"))
        refused = await drain(loop.submit(EngineRequest("bad", list(range(10)), bad)))
        assert refused[-1].finish_reason == "error"
        assert refused[-1].error.startswith("invalid_request: structured_outputs.regex")
    run_with_loop(mode, body)
