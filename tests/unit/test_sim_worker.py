"""SimWorker: step timing from the cost model, prefix hits, macro decode steps, exact KV events."""

import numpy as np
import pytest

from kvmesh.hashing import block_hashes
from kvmesh.protocol import BlockStored
from kvmesh.router.index import KVIndex
from kvmesh.router.sim.calibration import CostModel
from kvmesh.router.sim.worker import Job, SimWorker
from kvmesh.router.sim.workloads import SimRequest

B = 16
COST = CostModel()


def request(rid, prompt_len=100, output_len=30, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 1000, prompt_len + output_len).astype(np.int32)
    return SimRequest(request_id=rid, tokens=tokens, prompt_len=prompt_len, output_len=output_len,
                      hashes=np.array(block_hashes(tokens, B), dtype=np.uint64))


def worker(capacity=64):
    return SimWorker("w0", COST, capacity_blocks=capacity, max_batch=8, max_batched_tokens=256)


def run_until_idle(w, now):
    finished = []
    end = w.step_end
    while end is not None:
        _, done, end = w.on_step_end(end)
        finished += done
    return finished


def test_one_request_takes_a_prefill_step_then_its_decode_steps():
    w = worker()
    job = Job(request(0), arrival=0.0)
    end = w.submit(job, 0.0)
    prefill = COST.step_time(0, 0, 100, 100 * (0 + 101 / 2), 1)
    assert end == pytest.approx(prefill)
    started, finished, end = w.on_step_end(end)
    assert started == [job] and job.first_token_time == pytest.approx(prefill)
    decode = sum(COST.decode_step_time(1, 101 + j) for j in range(29))  # 29 more tokens, one macro step
    assert end == pytest.approx(prefill + decode)
    _, finished, end = w.on_step_end(end)
    assert finished == [job] and end is None
    assert job.finish_time == pytest.approx(prefill + decode)
    assert w.busy_time == pytest.approx(prefill + decode)


def test_prompt_blocks_are_stored_after_prefill_and_output_blocks_at_finish():
    w = worker()
    req = request(0)
    hashes = req.hashes.tolist()  # 130 tokens: 8 full blocks, 6 of them prompt
    w.submit(Job(req, 0.0), 0.0)
    w.on_step_end(w.step_end)
    assert w.take_event_batch(1.0).events == [BlockStored(hashes[:6], None, 96)]
    run_until_idle(w, 1.0)
    batch = w.take_event_batch(2.0)
    assert batch.seq == 1 and batch.events == [BlockStored(hashes[6:8], hashes[5], 32)]


def test_a_repeated_prompt_hits_all_but_its_last_token_block():
    w = worker()
    w.submit(Job(request(0), 0.0), 0.0)
    run_until_idle(w, 0.0)
    again = Job(request(1), 5.0)
    w.submit(again, 5.0)
    assert again.cached_tokens == 96 and again.prefill_remaining == 4
    assert w.take_event_batch(5.0).events[0] == BlockStored(request(0).hashes[:6].tolist(), None, 96)


def test_an_arrival_cuts_a_macro_decode_step_at_the_next_step_boundary():
    w = worker()
    first = Job(request(0, output_len=200), 0.0)
    w.submit(first, 0.0)
    _, _, macro_end = w.on_step_end(w.step_end)
    prefill_end = first.first_token_time
    step = COST.decode_step_time(1, 101)
    arrival = prefill_end + 2.5 * step  # during the third decode step
    new_end = w.submit(Job(request(1, seed=1), arrival), arrival)
    boundary = prefill_end + sum(COST.decode_step_time(1, 101 + j) for j in range(3))
    assert macro_end > new_end == pytest.approx(boundary)


def test_events_keep_an_index_equal_to_the_cache_under_eviction():
    w = worker(capacity=20)
    index = KVIndex()
    now = 0.0
    for rid in range(12):
        w.submit(Job(request(rid, seed=rid % 5), now), now)
        run_until_idle(w, now)
        batch = w.take_event_batch(now)
        if batch is not None:
            assert index.apply(batch)
        now += 10.0
        assert index.worker_blocks("w0") == set(w.cache.cached_hashes())
    assert w.cache.num_free == 20


def test_a_request_larger_than_the_pool_is_an_error():
    w = worker(capacity=4)
    with pytest.raises(ValueError, match="needs 9 KV blocks, more than a worker's 4"):
        w.submit(Job(request(0), 0.0), 0.0)
