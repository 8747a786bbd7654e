"""The engine in a child process (cluster/engine_process.py): a real Engine (tiny random model) in
its own interpreter, driven over a socket pair. Same asyncio-side contract as the in-process loop:
streams, aborts, snapshots, KV event batches, load and counters; a killed engine process fails its
streams retryably and reports unhealthy; a SIGSTOPped one is reported stalled until it runs again;
a stopped or orphaned one exits."""

import asyncio
import functools
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvmesh.cluster.engine_process import EngineProcessLoop
from kvmesh.config import EngineConfig
from kvmesh.protocol import EngineRequest, KVSnapshot
from kvmesh.sampling_params import SamplingParams

from engine_loop_support import drain, run_within  # tests/unit

CONFIG = EngineConfig(model="random:tiny-llama", device="cpu", worker_id="w0")
run = functools.partial(run_within, timeout_s=120)
STALL_S = 1.0  # the stall timeout these tests judge by


def test_streams_aborts_snapshots_and_counts_like_the_in_process_loop():
    from kvmesh.cluster.engine_loop import EngineLoop
    from kvmesh.worker.engine import Engine

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def main(make):
        loop = make(asyncio.get_running_loop())
        try:
            assert loop.info["model_name"] and loop.info["block_size"] == 16 and loop.info["vocab_size"] == 512
            deltas = await drain(loop.submit(EngineRequest("r1", list(range(40)), params)))
            tokens = [t for d in deltas for t in d.token_ids]
            batches = loop.take_kv_batches()
            assert batches and [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))
            snap = await loop.snapshot()
            assert isinstance(snap, KVSnapshot) and snap.seq == batches[-1].seq and len(snap.block_hashes) >= 2
            bad = await drain(loop.submit(EngineRequest("bad", list(range(10_000)), params)))
            assert bad[-1].finish_reason == "error" and "invalid_request" in bad[-1].error
            long = loop.submit(EngineRequest("long", list(range(20)), SamplingParams(max_tokens=5000, ignore_eos=True)))
            await long.get()
            loop.abort("long")
            while loop.load.running or loop.load.waiting:  # the engine reports the abort within a step or two
                await asyncio.sleep(0.01)
            assert loop.stats.steps > 0 and loop.stats.step_seconds > 0 and loop.ttft_p90() > 0
            assert loop.is_alive() and loop.stalled_for() == 0.0
            # (how many tokens "long" made before its abort landed depends on timing)
            assert loop.stats.generation_tokens >= 6 + 1
            counters = {k: v for k, v in vars(loop.stats).items()
                        if k not in ("steps", "step_seconds", "generation_tokens")}
            return tokens, counters, loop.load.kv_free_blocks
        finally:
            loop.stop()

    in_child = run(main(lambda ev: EngineProcessLoop(CONFIG, ev, num_threads=1)))
    in_thread = run(main(lambda ev: EngineLoop(Engine(CONFIG), ev)))
    assert in_child == in_thread
    tokens, counters, _ = in_child
    assert len(tokens) == 6 and counters["requests"] == 2 and counters["errors"] == 1


def test_a_killed_engine_process_fails_its_streams_retryably_and_reports_unhealthy_at_once():
    async def main():
        loop = EngineProcessLoop(CONFIG, asyncio.get_running_loop(), num_threads=1)
        wake_ups = []  # the engine's liveness at each wake-up of the worker's publisher
        loop.on_progress = lambda: wake_ups.append(loop.is_alive())
        try:
            out = loop.submit(EngineRequest("r", list(range(20)), SamplingParams(max_tokens=100_000, ignore_eos=True)))
            await out.get()
            assert loop.report(STALL_S).healthy
            os.kill(loop._proc.pid, signal.SIGKILL)
            last = (await drain(out))[-1]
            # the request is not at fault: marked for another worker to run it
            assert last.finish_reason == "error" and last.retryable and "engine process died" in last.error
            assert not loop.is_alive()
            assert wake_ups[-1] is False  # ... and the worker was woken to publish the death
            assert not loop.report(STALL_S).healthy and not loop.load.healthy
            # a request sent to the dead engine is refused at once, retryably; so is a snapshot
            refused = await drain(loop.submit(EngineRequest("late", [1, 2, 3], SamplingParams(max_tokens=2))))
            assert len(refused) == 1 and refused[0].retryable and refused[0].finish_reason == "error"
            with pytest.raises(RuntimeError, match="engine process died"):
                await loop.snapshot()
        finally:
            loop.stop()
    run(main())


def test_a_stopped_engine_process_is_reported_stalled_after_the_timeout_and_recovers_when_continued():
    async def main():
        loop = EngineProcessLoop(CONFIG, asyncio.get_running_loop(), num_threads=1)
        pid = loop._proc.pid
        try:
            out = loop.submit(EngineRequest("r", list(range(20)), SamplingParams(max_tokens=100_000, ignore_eos=True)))
            await out.get()
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                while not loop.report(STALL_S).stalled:  # bounded by the test's timeout
                    await asyncio.sleep(0.05)
                assert time.monotonic() - stopped >= STALL_S - 0.2  # not before the timeout
                assert loop.is_alive() and loop.report(STALL_S).healthy  # stalled, not dead
                while not out.empty():  # what it sent before it stopped
                    out.get_nowait()
            finally:
                os.kill(pid, signal.SIGCONT)
            await out.get()  # it steps again
            assert not loop.report(STALL_S).stalled and loop.stalled_for() < STALL_S
            loop.abort("r")
        finally:
            loop.stop()
    run(main())


def test_an_engine_process_exits_when_its_replica_goes_away():
    """The child's end of the socket sees EOF when the replica dies (here: the parent end closes)."""
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cluster.engine_process", str(child.fileno())],
                            pass_fds=(child.fileno(),))
    child.close()
    from multiprocessing.connection import Connection

    conn = Connection(parent.detach())
    conn.send(("config", (CONFIG, 1)))
    assert conn.poll(120) and conn.recv()[0] == "ready"
    conn.close()
    assert proc.wait(timeout=30) == 0


def test_an_engine_that_cannot_start_says_why():
    async def main():
        bad = EngineConfig(model="random:no-such-preset", device="cpu")
        with pytest.raises(RuntimeError, match="no-such-preset"):
            EngineProcessLoop(bad, asyncio.get_running_loop())
    run(main())


def test_an_engine_that_loads_too_slowly_times_out_and_is_stopped():
    import psutil

    def live_children():
        return {p.pid for p in psutil.Process().children()
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}

    before = live_children()

    async def main():
        with pytest.raises(TimeoutError, match="did not load its model"):
            EngineProcessLoop(CONFIG, asyncio.get_running_loop(), start_timeout_s=0.01)
    run(main())
    assert live_children() <= before
