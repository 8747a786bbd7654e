"""docs/ROUTING.md "Router copies": claims about `--router-copies N` (router/sim/copies.py) that no
other test would catch if they stopped being true.

- "N `RoutingState`s, each seeded from `--seed` and its number": two copies of one run break ties
  differently, the same seed repeats each copy's choices, another seed changes them, and a copy's
  choices depend on its number, not on how many copies there are.
- "loads every `--report-interval-s`, events and loads `--event-delay-s` late, `--loads-with-events`
  (the load travels with every batch)": a step's load reaches the copies with its batch, that
  delay after the step, only with the flag; without it the copies see it at the next report.
"""

import dataclasses

import numpy as np
import pytest

from kvmesh.hashing import block_hashes
from kvmesh.router.sim.calibration import CostModel
from kvmesh.router.sim.cluster import SimConfig
from kvmesh.router.sim.copies import RouterCopies
from kvmesh.router.sim.worker import Job, SimWorker
from kvmesh.router.sim.workloads import SimRequest

B = 16
CONFIG = SimConfig(num_workers=8, kv_blocks=400, max_batch=8, max_batched_tokens=2048, cap=None, seed=3)


def sim_workers(n):
    return [SimWorker(f"w{i}", CostModel(), capacity_blocks=200, max_batch=8, max_batched_tokens=1024)
            for i in range(n)]


def tie_breaks(seed: int, num_copies: int, routes_per_copy: int = 16) -> list[list[str]]:
    """Each copy's choices among 8 idle workers: least_loaded breaks every tie at random, and each
    route adds to the chosen worker's load in that copy only, so a copy's 16 choices are two random
    orders of the 8 workers drawn from that copy's generator."""
    config = dataclasses.replace(CONFIG, router_copies=num_copies, seed=seed)
    copies = RouterCopies(config, "least_loaded", sim_workers(8))
    picks: list[list[str]] = [[] for _ in range(num_copies)]
    for k in range(num_copies * routes_per_copy):  # requests go to copy k mod N
        picks[k % num_copies].append(copies.route([], 100, None, now=0.0)[0])
    return picks


def test_each_copy_is_seeded_from_the_seed_and_its_number():
    first = tie_breaks(seed=7, num_copies=2)
    for picks in first:  # the copies' own counts spread them: every worker twice
        assert sorted(picks) == sorted([f"w{i}" for i in range(8)] * 2)
    assert first[0] != first[1]  # two copies of one run: two generators
    assert tie_breaks(seed=7, num_copies=2) == first  # the same --seed repeats each copy
    other = tie_breaks(seed=8, num_copies=2)
    assert other[0] != first[0] and other[1] != first[1]  # derived from --seed
    # from the copy's number: copies 0 and 1 of a 3-copy run are those of the 2-copy run
    assert tie_breaks(seed=7, num_copies=3)[:2] == first


# ---- loads and events, late --------------------------------------------------------------------

def sim_request(rid, prompt_len=160, output_len=8):
    tokens = np.random.default_rng(rid).integers(0, 1000, prompt_len + output_len).astype(np.int32)
    return SimRequest(request_id=rid, tokens=tokens, prompt_len=prompt_len, output_len=output_len,
                      hashes=np.array(block_hashes(tokens, B), dtype=np.uint64))


@pytest.mark.parametrize("loads_with_events", [True, False])
def test_a_step_s_load_travels_with_its_batch_only_with_loads_with_events(loads_with_events):
    config = dataclasses.replace(CONFIG, router_copies=2, report_interval_s=1.0, event_delay_s=0.02,
                                 loads_with_events=loads_with_events)
    pool = sim_workers(2)
    copies = RouterCopies(config, "kv_events", pool)
    w0 = pool[0]
    w0.submit(Job(request=sim_request(1, output_len=64), arrival=0.0), 0.0)
    end = w0.step_end
    w0.on_step_end(end)  # the prompt is computed; the request decodes on
    assert w0.load(end).running == 1
    copies.on_step_end(w0, end)
    assert copies.next_time() == pytest.approx(end + 0.02)  # the batch, event_delay_s late
    copies.fire()
    for state in copies.copies:
        load = state.router.worker_state("w0").load
        assert state.router.index.overlap(request_prompt(), ["w0"])["w0"] == 10
        if loads_with_events:  # the load of the step's end came with the batch
            assert (load.running, load.timestamp) == (1, pytest.approx(end))
            assert state.router.worker_state("w0").reported_at == pytest.approx(end + 0.02)
        else:  # still the announcement's: loads come with the reports only
            assert (load.running, load.timestamp) == (0, 0.0)
    # the next report is sampled at report_interval_s and reaches the copies event_delay_s later
    assert copies.next_time() == pytest.approx(1.0)
    copies.fire()
    for state in copies.copies:
        assert state.router.worker_state("w0").load.timestamp != pytest.approx(1.0)
    assert copies.next_time() == pytest.approx(1.02)
    copies.fire()
    for state in copies.copies:
        assert state.router.worker_state("w0").load.timestamp == pytest.approx(1.0)


def request_prompt():
    return sim_request(1, output_len=64).hashes[:10].tolist()
