"""The worker's engine loop: a real Engine (tiny random model) on its own thread, bridged to an
asyncio loop: streams deltas, aborts, snapshots, KV event batches, load and TTFT for the worker."""

import asyncio
import dataclasses
import functools

import pytest

from kvmesh.cluster.engine_loop import EngineLoop
from kvmesh.config import EngineConfig
from kvmesh.protocol import EngineRequest, KVSnapshot
from kvmesh.sampling_params import SamplingParams

from engine_loop_support import drain, run_within  # tests/unit


@pytest.fixture(scope="module")
def engine():
    from kvmesh.worker.engine import Engine

    return Engine(EngineConfig(model="random:tiny-llama", device="cpu", worker_id="w0"))


run = functools.partial(run_within, timeout_s=60)


def test_streams_a_request_to_its_finish_and_reports_events_load_and_ttft(engine):
    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        try:
            out = loop.submit(EngineRequest("r1", list(range(40)), SamplingParams(max_tokens=5, temperature=0)))
            deltas = await drain(out)
            assert [d.finish_reason for d in deltas][-1] == "length"
            assert sum(len(d.token_ids) for d in deltas) == 5
            batches = loop.take_kv_batches()
            assert batches and [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))
            snap = await loop.snapshot()
            assert isinstance(snap, KVSnapshot) and snap.seq == batches[-1].seq and len(snap.block_hashes) >= 2
            assert loop.load.running == 0 and loop.load.kv_total_blocks > 0
            assert loop.stats.requests == 1 and loop.stats.prompt_tokens == 40
            assert loop.ttft_p90() > 0.0
            assert loop.stalled_for() == 0.0 and loop.is_alive()
        finally:
            loop.stop()
    run(main())


def test_abort_ends_the_request_and_frees_it(engine):
    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        try:
            out = loop.submit(EngineRequest("long", list(range(20)), SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)))
            first = await out.get()
            assert not first.finished
            loop.abort("long")
            assert loop.num_streams == 0
            for _ in range(200):  # the engine thread applies the abort at its next step
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert not engine.has_unfinished_requests()
        finally:
            loop.stop()
    run(main())


def test_a_refused_request_gets_an_error_delta_naming_the_problem(engine):
    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        try:
            too_long = list(range(10)) * 300
            out = loop.submit(EngineRequest("bad", too_long, SamplingParams(max_tokens=2)))
            d = await out.get()
            assert d.finish_reason == "error" and d.error.startswith("invalid_request: prompt is 3000 tokens")
        finally:
            loop.stop()
    run(main())


def test_a_consumer_that_fell_behind_gets_what_is_waiting_as_one_delta(engine):
    """The worker sends one stream item per read: every delta already queued, merged in order."""
    from kvmesh.cluster.engine_loop import coalesce

    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        try:
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
            deltas = await drain(loop.submit(EngineRequest("late", list(range(30)), params)))
        finally:
            loop.stop()
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
    run(main())


def test_an_engine_thread_that_dies_fails_its_streams_retryably_like_a_dead_engine_process():
    """Same contract as a killed engine process (test_cluster_engine_process.py): open streams
    and later submits end with a retryable error, the worker is woken, the load says unhealthy."""
    from kvmesh.worker.engine import Engine

    engine = Engine(EngineConfig(model="random:tiny-llama", device="cpu", worker_id="w1"))

    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        wake_ups = []
        loop.on_progress = lambda: wake_ups.append(loop.is_alive())
        try:
            out = loop.submit(EngineRequest("r", list(range(20)), SamplingParams(max_tokens=100_000, ignore_eos=True)))
            await out.get()
            engine.step = _failing_step  # the fault: the next step raises (a CUDA error, a bug)
            last = (await drain(out))[-1]
            assert last.finish_reason == "error" and last.retryable and "engine loop died" in last.error
            assert not loop.is_alive() and wake_ups[-1] is False
            assert not loop.report(stall_timeout_s=1.0).healthy
            refused = await drain(loop.submit(EngineRequest("late", [1, 2, 3], SamplingParams(max_tokens=2))))
            assert len(refused) == 1 and refused[0].retryable
            with pytest.raises(RuntimeError, match="engine loop died"):
                await loop.snapshot()
        finally:
            loop.stop()
    run(main())


def _failing_step():
    raise RuntimeError("injected engine failure")
